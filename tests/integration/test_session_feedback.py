"""Acceptance for session verdicts on the real broker, app, model and `flywheel join`.

An agent session of three turns (three chat completions with one `session_id`, through the
app, so three GenerationLogged on `sessions`), then ONE signed verdict about the session on
the webhook: `experiences` gets exactly three records, one per turn, in generation order, with
the verdict's reward discounted back from the last turn (`FLYWHEEL_JOIN__SESSION_DISCOUNT`
0.5). The same verdict again, through the webhook (a duplicate there) and re-produced to the
topic as an intake that crashed before its receipt would, changes nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from app.cli.stack import running_stack
from app.settings import Settings
from ingest.config import KafkaConfig
from ingest.events import ExperienceReady, GenerationLogged, experience_id_for
from ingest.log import EventProducer
from ingest.signing import SIGNATURE_HEADER, sign
from ingest.topic_reader import read_all, read_raw
from tests.integration.helpers import JoinProcess, wait_until

pytestmark = pytest.mark.integration
SECRET = "session-secret"


def logged(kafka: KafkaConfig, generation_ids: list[str]) -> list[GenerationLogged]:
    found = {g.generation_id: g for g in read_all(kafka, kafka.topics.sessions,
                                                  GenerationLogged)}
    return [found[g] for g in generation_ids if g in found]


def experience_records(kafka: KafkaConfig) -> list[ExperienceReady]:
    return [ExperienceReady.model_validate_json(v)
            for _, v in read_raw(kafka, kafka.topics.experiences, quiet_ms=200)]


def test_one_verdict_judges_every_turn_of_a_session_once(settings: Settings,
                                                         tmp_path: Path) -> None:
    settings = settings.model_copy(update={"feedback_secrets": [SecretStr(SECRET)]})
    kafka = settings.kafka_config(str(settings.kafka_bootstrap))
    session_id = f"agent-{uuid.uuid4().hex[:12]}"
    with running_stack(settings) as stack, httpx.Client(base_url=stack.base_url,
                                                        timeout=60) as http:
        turns = []
        messages = [{"role": "user", "content": "def add(a, b):"}]
        for i in range(3):  # one completion per model turn, the same session
            r = http.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 6, "seed": i, "session_id": session_id})
            assert r.status_code == 200, r.text
            turns.append(r.json()["id"])
            messages += [r.json()["choices"][0]["message"],
                         {"role": "user", "content": f"and now step {i + 1}"}]
        wait_until(lambda: len(logged(kafka, turns)) == 3, "the session's three generations")
        generations = logged(kafka, turns)
        assert {g.session_id for g in generations} == {session_id}
        assert len({g.created_at for g in generations}) == 3

        def post(payload: dict[str, object]) -> httpx.Response:
            body = json.dumps(payload).encode()
            return http.post("/v1/feedback", content=body, headers={
                "content-type": "application/json", SIGNATURE_HEADER: sign(SECRET, None, body)})

        verdict = {"event_id": f"verdict-{uuid.uuid4().hex}", "session_id": session_id,
                   "kind": "accept", "source": "agent"}
        join = JoinProcess(settings, tmp_path / "join", f"join-{uuid.uuid4().hex[:8]}",
                           tmp_path / "join.db",
                           env={"FLYWHEEL_JOIN__SESSION_DISCOUNT": "0.5"})
        try:
            first = post(verdict)
            assert first.status_code == 202 and first.json()["duplicate"] is False, first.text
            wait_until(lambda: len(experience_records(kafka)) >= 3, "three experiences",
                     detail=lambda: join.log.read_text()[-2000:])
            time.sleep(1.0)  # a fourth would land now if the join were to make one
            experiences = experience_records(kafka)

            again = post(verdict)  # the webhook's own dedupe
            assert again.status_code == 202 and again.json()["duplicate"] is True
            [(key, raw)] = [(k, v) for k, v in read_raw(kafka, kafka.topics.feedback)]
            assert key == session_id.encode()  # keyed (and partitioned) by the session
            producer = EventProducer(kafka)  # the intake crashed between ack and receipt:
            try:  # the same record twice on the topic
                producer.send_raw(kafka.topics.feedback, key, raw).get(timeout=10)
            finally:
                producer.close()
            time.sleep(2 * settings.join.session_settle_s + 1.0)
        finally:
            log = join.stop()
        after = experience_records(kafka)

    assert len(experiences) == 3, experiences
    by_turn = sorted(experiences, key=lambda x: x.turn or 0)
    assert [x.generation_id for x in by_turn] == turns  # generation order
    assert [x.reward for x in by_turn] == [0.25, 0.5, 1.0]  # accept = 1.0, discount 0.5
    for k, (x, g) in enumerate(zip(by_turn, generations, strict=True)):
        assert (x.session_id, x.turn, x.turns) == (session_id, k, 3)
        assert x.feedback_event_ids == [verdict["event_id"]] and x.feedback_kind == "accept"
        assert x.experience_id == experience_id_for(str(verdict["event_id"]), g.generation_id)
        assert (x.prompt_token_ids, x.completion_token_ids, x.logprobs, x.routed_experts,
                x.model_version) == (g.prompt_token_ids, g.completion_token_ids, g.logprobs,
                                     g.routed_experts, g.model_version)
    assert sorted(x.experience_id for x in after) == sorted(x.experience_id for x in experiences)
    [stats] = [json.loads(line)["join"] for line in log.splitlines() if line.startswith('{"join"')]
    assert (stats["verdicts"], stats["verdicts_expanded"], stats["duplicates"]) == (1, 1, 1), log
