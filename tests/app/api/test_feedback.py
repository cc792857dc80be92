"""Feedback webhooks over HTTP on the real broker, the real SQL ledger and the real app.

Signed events reach `feedback` exactly once whatever the duplicates, keyed and partitioned by
the generation they judge or, for a session verdict, by the session; unsigned, forged or stale
requests are 401, malformed ones 422 naming the field (an event naming both a generation and a
session, or neither, too), oversized ones 413, and none of those reach Kafka.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.cli.stack import RunningStack, running_stack
from app.settings import Settings
from ingest.broker import EmbeddedBroker
from ingest.events import FeedbackReceived
from ingest.log import EventProducer, ensure_topics, partition_for
from ingest.signing import SIGNATURE_HEADER, sign
from ingest.topic_reader import TopicReader, read_all

SECRETS = ["new-secret", "old-secret"]


@pytest.fixture(scope="module")
def stack(broker: EmbeddedBroker, model_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    suffix = uuid.uuid4().hex[:8]
    topics = Settings().topics.model_copy(update={"feedback": f"feedback-{suffix}",
                                                  "sessions": f"sessions-{suffix}"})
    settings = Settings(data_dir=tmp_path_factory.mktemp("feedback"), port=0,
                        kafka_bootstrap=broker.bootstrap, topics=topics, model_dir=model_dir,
                        feedback_secrets=SECRETS, feedback_batch_max=50,
                        max_body_bytes=64 * 1024)
    ensure_topics(settings.kafka_config(broker.bootstrap))
    with running_stack(settings) as running:
        yield running


@pytest.fixture
def http(stack: RunningStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, timeout=30) as client:
        yield client


def post(http: httpx.Client, path: str, payload: object, *, secret: str = "new-secret",
         ts: int | None = None) -> httpx.Response:
    body = json.dumps(payload).encode()
    return http.post(path, content=body, headers={
        "content-type": "application/json", SIGNATURE_HEADER: sign(secret, ts, body)})


def event(kind: str = "accept", **fields: object) -> dict[str, object]:
    return {"event_id": f"e-{uuid.uuid4().hex}", "generation_id": f"g-{uuid.uuid4().hex}",
            "kind": kind, **fields}


def produced(stack: RunningStack) -> list[FeedbackReceived]:
    return read_all(stack.kafka, stack.kafka.topics.feedback, FeedbackReceived)


def produced_ids(stack: RunningStack, ids: set[str]) -> list[str]:
    return [f.event_id for f in produced(stack) if f.event_id in ids]


def placed(stack: RunningStack, event_ids: set[str]) -> dict[str, tuple[bytes | None, int]]:
    """Where the webhook put `event_ids` on `feedback`: (key, partition) by event id."""
    reader = TopicReader(stack.kafka, stack.kafka.topics.feedback, FeedbackReceived)
    try:
        found: dict[str, tuple[bytes | None, int]] = {}
        deadline = time.monotonic() + 30
        while set(found) < event_ids and time.monotonic() < deadline:
            for record in reader.poll(timeout_ms=200):
                if record.event.event_id in event_ids:
                    found[record.event.event_id] = (record.key, record.partition)
        return found
    finally:
        reader.close()


def test_signed_event_is_produced_once(stack: RunningStack, http: httpx.Client) -> None:
    e = event("edit_kept", value=0.25, source="editor")
    first = post(http, "/v1/feedback", e)
    again = post(http, "/v1/feedback", e, secret="old-secret")  # rotation: both verify
    assert (first.status_code, again.status_code) == (202, 202), first.text
    assert (first.json()["duplicate"], again.json()["duplicate"]) == (False, True)
    [logged] = [f for f in produced(stack) if f.event_id == e["event_id"]]
    assert (logged.generation_id, logged.kind, logged.value, logged.source) == (
        e["generation_id"], "edit_kept", 0.25, "editor")


def test_batch_flags_duplicates_within_and_across_requests(stack: RunningStack,
                                                           http: httpx.Client) -> None:
    seen = event("thumbs_up")
    assert post(http, "/v1/feedback", seen).status_code == 202
    fresh = [event("reject"), event("thumbs_down")]
    batch = [seen, fresh[0], fresh[1], fresh[0]]
    r = post(http, "/v1/feedback/batch", {"events": batch})
    assert r.status_code == 202, r.text
    assert (r.json()["accepted"], r.json()["duplicates"]) == (2, 2)
    assert [x["duplicate"] for x in r.json()["results"]] == [True, False, False, True]
    ids = {e["event_id"] for e in [seen, *fresh]}
    assert sorted(produced_ids(stack, ids)) == sorted(ids)  # type: ignore[type-var]


def test_a_session_verdict_is_keyed_and_partitioned_by_its_session(
        stack: RunningStack, http: httpx.Client) -> None:
    session = f"agent-session-{uuid.uuid4().hex}"
    single = {"event_id": f"v-{uuid.uuid4().hex}", "session_id": session, "kind": "reject"}
    batched = [{"event_id": f"v-{uuid.uuid4().hex}", "session_id": f"s-{i}-{session}",
                "kind": "thumbs_up"} for i in range(3)]
    per_generation = event("accept")
    r = post(http, "/v1/feedback", single)
    assert r.status_code == 202 and r.json() == {"event_id": single["event_id"],
                                                 "duplicate": False}, r.text
    r = post(http, "/v1/feedback/batch", {"events": [*batched, per_generation, single]})
    assert r.status_code == 202, r.text
    assert [x["duplicate"] for x in r.json()["results"]] == [False] * 4 + [True]
    sent = [single, *batched, per_generation]
    where = placed(stack, {str(e["event_id"]) for e in sent})
    producer = EventProducer(stack.kafka)
    try:
        partitions = producer.partitions(stack.kafka.topics.feedback)
    finally:
        producer.close()
    for e in sent:
        key = str(e.get("session_id") or e["generation_id"]).encode()
        assert where[str(e["event_id"])] == (key, partition_for(key, partitions))
    [logged] = [f for f in produced(stack) if f.event_id == single["event_id"]]
    assert (logged.session_id, logged.generation_id, logged.kind, logged.schema_version) == (
        session, None, "reject", 2)


@pytest.mark.parametrize("subject, word", [
    ({"generation_id": "g", "session_id": "s"}, "both"), ({}, "neither")])
def test_a_generation_or_a_session_not_both_nor_neither(
        stack: RunningStack, http: httpx.Client, subject: dict[str, str], word: str) -> None:
    e = {"event_id": f"e-{uuid.uuid4().hex}", "kind": "accept", **subject}
    for path, payload, param in (("/v1/feedback", e, None),
                                 ("/v1/feedback/batch", {"events": [event(), e]}, "events.1")):
        r = post(http, path, payload)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["param"] == param, r.text
        assert "exactly one of generation_id" in error["message"], r.text
        assert f"not {word}" in error["message"], r.text
    assert produced_ids(stack, {str(e["event_id"])}) == []


def bad_header(case: str, body: bytes) -> dict[str, str]:
    if case == "unsigned":
        return {}
    if case == "forged":
        return {SIGNATURE_HEADER: sign("new-secret", None, body + b" ")}
    if case == "stale":
        return {SIGNATURE_HEADER: sign("new-secret", int(time.time()) - 3600, body)}
    return {SIGNATURE_HEADER: sign("retired", None, body)}


@pytest.mark.parametrize("case", ["unsigned", "forged", "stale", "retired secret"])
def test_bad_signatures_are_401_and_never_produced(stack: RunningStack, http: httpx.Client,
                                                   case: str) -> None:
    e = event()
    before = rejected(http, "invalid_signature")
    for path, body in (("/v1/feedback", json.dumps(e).encode()),
                       ("/v1/feedback/batch", json.dumps({"events": [e]}).encode())):
        r = http.post(path, content=body, headers=bad_header(case, body))
        assert r.status_code == 401, r.text
    assert produced_ids(stack, {str(e["event_id"])}) == []
    assert rejected(http, "invalid_signature") == before + 2  # counted by reason


def rejected(http: httpx.Client, reason: str) -> float:
    """`flywheel_feedback_rejected_total{reason}` as /metrics gives it."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(http.get("/metrics").text)
               for s in f.samples if s.name == "flywheel_feedback_rejected_total"
               and s.labels.get("reason") == reason)


@pytest.mark.parametrize("path, payload, field", [
    ("/v1/feedback", {"generation_id": "g", "kind": "accept"}, "event_id"),
    ("/v1/feedback", {"event_id": "e", "generation_id": "g", "kind": "loved_it"}, "kind"),
    ("/v1/feedback", {"event_id": "e", "generation_id": "g", "kind": "edit_kept"}, "value"),
    ("/v1/feedback/batch", {"events": []}, "events"),
    ("/v1/feedback/batch", {"events": [{"event_id": "e", "generation_id": "g",
                                        "kind": "accept", "value": "much"}]}, "value"),
])
def test_malformed_is_422_naming_the_field(stack: RunningStack, http: httpx.Client, path: str,
                                           payload: dict, field: str) -> None:
    before, refused = len(produced(stack)), rejected(http, "invalid_body")
    r = post(http, path, payload)
    assert r.status_code == 422, r.text
    assert rejected(http, "invalid_body") == refused + 1
    error = r.json()["error"]
    assert field in (error["param"] or "") or field in error["message"], r.text
    assert len(produced(stack)) == before


def test_malformed_json_is_422(http: httpx.Client) -> None:
    body = b'{"event_id": "e",'
    r = http.post("/v1/feedback", content=body, headers={SIGNATURE_HEADER: sign(
        "new-secret", None, body)})
    assert r.status_code == 422, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_json", None)


@pytest.mark.parametrize("body", [b'{"event_id": "e",', b'{"events": []}', b""])
def test_the_signature_is_checked_before_the_body_is_read(http: httpx.Client,
                                                          body: bytes) -> None:
    for path in ("/v1/feedback", "/v1/feedback/batch"):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 401, r.text


def test_the_server_sets_the_time_received_and_the_schema_version(
        stack: RunningStack, http: httpx.Client) -> None:
    e = event(received_at="2001-01-01T00:00:00Z", schema_version=1, occurred_at=None)
    sent_at = time.time()
    assert post(http, "/v1/feedback", e).status_code == 202
    [logged] = [f for f in produced(stack) if f.event_id == e["event_id"]]
    assert logged.schema_version == 2
    assert logged.received_at.timestamp() >= sent_at - 1
    assert logged.occurred_at.timestamp() >= sent_at - 1  # null: when received


def test_oversized_is_413(stack: RunningStack, http: httpx.Client) -> None:
    before = {r: rejected(http, r) for r in ("batch_too_large", "request_too_large")}
    too_many = [event() for _ in range(51)]
    r = post(http, "/v1/feedback/batch", {"events": too_many})
    assert r.status_code == 413, r.text
    huge = event(source="x" * 10, padding="y" * 70_000)
    assert post(http, "/v1/feedback", huge).status_code == 413  # refused by its Content-Length
    assert {r: rejected(http, r) - n for r, n in before.items()} == {
        "batch_too_large": 1, "request_too_large": 1}
    assert produced_ids(stack, {str(e["event_id"]) for e in [*too_many, huge]}) == []
