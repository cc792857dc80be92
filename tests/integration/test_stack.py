"""The stack end to end on the real broker, the real DB and the real tiny model.

Completions over HTTP land on `sessions` as `GenerationLogged` whose token ids decode to the
returned text and whose logprobs equal the engine's; feedback lands on `feedback`; malformed
feedback is refused with 422 naming the field and nothing reaches Kafka for it.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from app.cli.stack import running_stack
from app.settings import Settings
from ingest.events import FeedbackReceived, GenerationLogged
from ingest.topic_reader import read_all
from serving.engine import GenerationRequest
from serving.torch_engine import TorchEngine

pytestmark = pytest.mark.integration
PROMPTS = ["def add(a, b):", "Reverse a string.", "def is_even(n):"]


def test_completions_and_feedback_reach_kafka(settings: Settings) -> None:
    with running_stack(settings) as stack, httpx.Client(base_url=stack.base_url,
                                                        timeout=60) as http:
        replies = []
        for i, prompt in enumerate(PROMPTS):
            r = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
                "temperature": 0.9, "seed": 100 + i})
            assert r.status_code == 200, r.text
            assert r.headers["X-Flywheel-Generation-Id"] == r.json()["id"]
            replies.append(r.json())
        for i, reply in enumerate(replies):
            r = http.post("/v1/feedback", json={"event_id": f"evt-{i}",
                                                "generation_id": reply["id"], "kind": "accept"})
            assert r.status_code == 202, r.text
        status = http.get("/admin/status", headers={
            "Authorization": f"Bearer {settings.admin_secret().get_secret_value()}"}).json()
        assert status["completions"] == len(PROMPTS)
        sessions = read_all(stack.kafka, stack.kafka.topics.sessions, GenerationLogged)
        feedback = read_all(stack.kafka, stack.kafka.topics.feedback, FeedbackReceived)

    by_id = {s.generation_id: s for s in sessions}
    assert set(by_id) == {r["id"] for r in replies}
    engine = TorchEngine.load(settings.resolved_model_dir)
    try:
        for i, reply in enumerate(replies):
            logged = by_id[reply["id"]]
            tokens = logged.completion_token_ids.tolist()
            assert engine.decode(tokens) == reply["choices"][0]["message"]["content"]
            assert logged.model_sha256 == engine.version.sha256
            assert reply["system_fingerprint"] == engine.version.fingerprint
            again = asyncio.run(engine.generate(GenerationRequest(
                prompt_token_ids=logged.prompt_token_ids.tolist(), max_tokens=12,
                temperature=0.9, seed=100 + i)))
            assert again.token_ids == tokens
            assert logged.logprobs.unpack().tolist() == again.logprobs
    finally:
        engine.close()
    assert sorted((f.event_id, f.generation_id) for f in feedback) == sorted(
        (f"evt-{i}", r["id"]) for i, r in enumerate(replies))


@pytest.mark.parametrize("body, field", [
    ({"generation_id": "g", "kind": "accept"}, "event_id"),
    ({"event_id": "e", "generation_id": "g", "kind": "loved_it"}, "kind"),
    ({"event_id": "e", "generation_id": "g", "kind": "edit_kept"}, "value"),
])
def test_malformed_feedback_is_422_and_never_produced(settings: Settings, body: dict,
                                                      field: str) -> None:
    with running_stack(settings) as stack, httpx.Client(base_url=stack.base_url) as http:
        r = http.post("/v1/feedback", json=body)
        assert r.status_code == 422, r.text
        assert field in r.text
        assert read_all(stack.kafka, stack.kafka.topics.feedback, FeedbackReceived) == []


def test_duplicate_feedback_is_accepted_once(settings: Settings) -> None:
    event = {"event_id": f"e-{uuid.uuid4().hex}", "generation_id": "g-1", "kind": "reject"}
    with running_stack(settings) as stack, httpx.Client(base_url=stack.base_url) as http:
        first = http.post("/v1/feedback", json=event)
        second = http.post("/v1/feedback", json=event)
        assert (first.status_code, second.status_code) == (202, 202)
        assert (first.json()["duplicate"], second.json()["duplicate"]) == (False, True)
        assert len(read_all(stack.kafka, stack.kafka.topics.feedback, FeedbackReceived)) == 1
