"""Acceptance for feedback -> join -> experiences on the real broker, app, SQL and model.

5,000 feedback events over signed HTTP (mostly batches, some single): 10% repeated event ids,
2% malformed (422, never produced); most feedback arrives before its session; 2% of raw
records on the topics are undecodable. The join runs as a real `flywheel join` subprocess (or
two, in one group) and is SIGKILLed twice mid-stream. Then `experiences` holds exactly one
record per unique matched event, the DLQ holds every undecodable record with its reason, and
nothing else is missing.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest
from pydantic import SecretStr

from app.cli.stack import running_stack
from app.settings import Settings
from bench.feedback import synthetic_session
from ingest.config import KafkaConfig, RewardMap
from ingest.events import (
    DeadLetter,
    ExperienceReady,
    FeedbackReceived,
    GenerationLogged,
    experience_id_for,
)
from ingest.feedback_rewards import reward_for
from ingest.log import EventProducer
from ingest.signing import SIGNATURE_HEADER, sign
from ingest.topic_reader import read_raw
from tests.integration.helpers import JoinProcess, wait_until

pytestmark = pytest.mark.integration
SECRET = "integration-secret"
KINDS = ["accept", "reject", "thumbs_up", "thumbs_down", "copied", "regenerated",
         "followup_dissatisfied", "edit_kept"]


def experience_count(kafka: KafkaConfig) -> int:
    """Records on `experiences`, read (Tansu's end offsets count a compressed batch as one)."""
    return len(read_raw(kafka, kafka.topics.experiences, quiet_ms=200))


def missing_detail(kafka: KafkaConfig, matched: dict[str, dict], real: list[str]) -> str:
    have = {ExperienceReady.model_validate_json(v).feedback_event_ids[0]
            for _, v in read_raw(kafka, kafka.topics.experiences)}
    gone = [e for k, e in matched.items() if k not in have]
    sessions = {k for k, _ in read_raw(kafka, kafka.topics.sessions)}
    return (f"{len(gone)} missing, e.g. {gone[:3]}; real {real}; "
            f"their sessions logged: {[g.encode() in sessions for g in real]}")


@pytest.mark.parametrize("members", [1, 2])
def test_feedback_join_survives_sigkill(settings: Settings, tmp_path: Path,
                                        members: int) -> None:
    """With two members (one group, one SQLite state) each SIGKILL hits one of them: its
    partitions move to the other and back while both are mid-stream."""
    settings = settings.model_copy(update={"feedback_secrets": [SecretStr(SECRET)],
                                           "feedback_batch_max": 500})
    kafka = settings.kafka_config(str(settings.kafka_bootstrap))
    rng = np.random.default_rng(7)
    with running_stack(settings) as stack, httpx.Client(base_url=stack.base_url,
                                                        timeout=60) as http:
        # Generations: 3 real ones through the app, 1,500 synthetic, 100 that never log.
        real = []
        for i in range(3):
            r = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"def f{i}(x):"}], "max_tokens": 8,
                "seed": i})
            assert r.status_code == 200, r.text
            real.append(r.json()["id"])
        synthetic = [f"gen-{uuid.uuid4().hex}" for _ in range(1500)]
        orphans = [f"gen-orphan-{i}" for i in range(100)]
        targets = real + synthetic + orphans

        # 4,400 unique valid events, 500 repeats, 100 malformed: 5,000 over HTTP.
        events = []
        for i in range(4400):
            kind = KINDS[i % len(KINDS)]
            events.append({"event_id": f"evt-{uuid.uuid4().hex}",
                           "generation_id": targets[int(rng.integers(len(targets)))] if i >= len(
                               targets) else targets[i], "kind": kind,
                           "value": round(float(rng.random()), 3) if kind == "edit_kept" else None,
                           "source": "it"})
        repeats = [events[int(j)] for j in rng.integers(0, len(events), 500)]
        malformed = [{"event_id": f"bad-{i}", "generation_id": "g",
                      "kind": ["loved_it", "edit_kept", "accept"][i % 3],
                      **({"value": "lots"} if i % 3 == 2 else {})} for i in range(100)]
        stream = events + repeats
        order = rng.permutation(len(stream))
        stream = [stream[k] for k in order]
        thirds = [stream[:1600], stream[1600:3200], stream[3200:]]

        def post(path: str, payload: object) -> httpx.Response:
            body = json.dumps(payload).encode()
            return http.post(path, content=body, headers={
                "content-type": "application/json", SIGNATURE_HEADER: sign(SECRET, None, body)})

        def send_feedback(chunk: list[dict]) -> None:
            single, batched = chunk[:70], chunk[70:]
            for e in single:
                assert post("/v1/feedback", e).status_code == 202
            for start in range(0, len(batched), 250):
                r = post("/v1/feedback/batch", {"events": batched[start:start + 250]})
                assert r.status_code == 202, r.text

        for bad in malformed:
            r = post("/v1/feedback", bad)
            assert r.status_code == 422, r.text
            param = r.json()["error"]["param"]
            assert param is None or param.split(".")[-1] in ("kind", "value"), r.text

        producer = EventProducer(kafka)
        sessions = {g: synthetic_session(g, rng) for g in synthetic}
        bad_raw = [b"\x00garbage-%d" % i for i in range(80)] + [
            json.dumps({"event": "FeedbackReceived", "schema_version": 9,
                        "event_id": f"v9-{i}", "generation_id": "g",
                        "kind": "accept"}).encode() for i in range(20)]
        bad_sessions = [b'{"event": "GenerationLogged", "generation_id": "x%d"}' % i
                        for i in range(10)]

        def produce_sessions(gens: list[str]) -> None:
            for g in gens:
                producer.send(kafka.topics.sessions, g, sessions[g])
            producer.flush()

        # Feedback first, then the join, then sessions, with two SIGKILLs mid-stream.
        send_feedback(thirds[0])
        group = f"join-{uuid.uuid4().hex[:8]}"
        joins = [JoinProcess(settings, tmp_path / f"join-{i}", group, tmp_path / "join.db")
                 for i in range(members)]
        try:
            for raw in bad_raw[:50] + bad_sessions[:5]:
                producer.send_raw(kafka.topics.feedback if raw not in bad_sessions
                                  else kafka.topics.sessions, "g", raw)
            produce_sessions(synthetic[:700])
            send_feedback(thirds[1])
            wait_until(lambda: experience_count(kafka) > 300, "experiences")
            joins[0].kill()
            joins[0].start()
            produce_sessions(synthetic[700:])
            for raw in bad_raw[50:]:
                producer.send_raw(kafka.topics.feedback, "g", raw)
            for raw in bad_sessions[5:]:
                producer.send_raw(kafka.topics.sessions, "g", raw)
            producer.flush()
            before = experience_count(kafka)
            wait_until(lambda: experience_count(kafka) > before + 200,
                     "experiences after the first restart")
            joins[-1].kill()
            send_feedback(thirds[2])
            joins[-1].start()

            matched = {e["event_id"]: e for e in events if e["generation_id"] not in orphans}
            # Tansu's end offsets can trail the last record of a batch: count what is there.
            wait_until(lambda: len({k for k, _ in read_raw(kafka, kafka.topics.experiences)})
                     >= len(matched),
                     f"{len(matched)} experiences", timeout_s=60,
                     detail=lambda: missing_detail(kafka, matched, real))
            time.sleep(1.0)  # a duplicate would land now if the join were to make one
        finally:
            log = "".join(join.stop() for join in joins)
            producer.close()
        experiences = [ExperienceReady.model_validate_json(v)
                       for _, v in read_raw(kafka, kafka.topics.experiences)]
        feedback_records = read_raw(kafka, kafka.topics.feedback)
        letters = [DeadLetter.model_validate_json(v) for _, v in read_raw(kafka, kafka.topics.dlq)]
        logged = {g.generation_id: g for g in (GenerationLogged.model_validate_json(v)
                                               for _, v in read_raw(kafka, kafka.topics.sessions)
                                               if v not in bad_sessions)}

    # The webhook produced every unique valid event exactly once, nothing malformed.
    produced = Counter(FeedbackReceived.model_validate_json(v).event_id
                       for _, v in feedback_records if v not in bad_raw)
    assert set(produced) == {e["event_id"] for e in events}
    assert max(produced.values()) == 1

    # Exactly one experience per unique matched event, with its reward and its session's tokens.
    by_id = Counter(x.experience_id for x in experiences)
    missing = {experience_id_for(e): e for e in matched}.keys() - set(by_id)
    assert not missing, ([m for e, m in matched.items() if experience_id_for(e) in missing][:5],
                         real, [g for g in real if g in logged], log[-2000:])
    assert set(by_id) == {experience_id_for(e) for e in matched}
    assert max(by_id.values()) == 1, f"duplicates on the topic: {by_id.most_common(3)}"
    rewards = RewardMap()
    for x in experiences:
        e = matched[x.feedback_event_ids[0]]
        assert x.generation_id == e["generation_id"]
        assert x.reward == pytest.approx(reward_for(FeedbackReceived(**{
            k: v for k, v in e.items() if v is not None}), rewards))
        session = logged[x.generation_id]
        assert (x.completion_token_ids, x.logprobs, x.routed_experts) == (
            session.completion_token_ids, session.logprobs, session.routed_experts)
    assert {x.generation_id for x in experiences} >= set(real)

    # The DLQ holds every undecodable record with its reason, and nothing else.
    assert {d.raw() for d in letters} == set(bad_raw) | set(bad_sessions)
    assert all(d.reason and d.consumer == "join" for d in letters)
