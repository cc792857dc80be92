"""The join on the real broker and real SQLite: matches in either order, dedupes, rewards,
expires to the DLQ, dead-letters undecodable records, and survives a crash between produce and
commit without producing twice."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import get_args

import numpy as np
import pytest

from bench.feedback import synthetic_session
from ingest.config import KafkaConfig, RewardMap
from ingest.events import (
    DeadLetter,
    ExperienceReady,
    FeedbackKind,
    FeedbackReceived,
    experience_id_for,
)
from ingest.feedback_rewards import reward_for
from ingest.join import Join
from ingest.log import EventProducer
from ingest.topic_reader import read_all
from tests.ingest.conftest import Clock
from tests.ingest.helpers import run_until


def feedback(generation_id: str, kind: str = "accept", **fields: object) -> FeedbackReceived:
    return FeedbackReceived(event_id=f"e-{uuid.uuid4().hex}", generation_id=generation_id,
                            kind=kind, **fields)  # type: ignore[arg-type]


def test_every_kind_has_a_reward() -> None:
    rewards = RewardMap(edit_kept_scale=2.0, edit_kept_offset=-1.0)
    for kind in get_args(FeedbackKind):
        value = 0.75 if kind == "edit_kept" else None
        reward_for(feedback("g", kind, value=value), rewards)
    assert reward_for(feedback("g", "edit_kept", value=0.75), rewards) == 0.5
    assert reward_for(feedback("g", "thumbs_down"), RewardMap(thumbs_down=0.0)) == 0.0


@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
def test_feedback_before_session_joins_once_per_unique_event(
        kafka: KafkaConfig, producer: EventProducer, make_join: Callable[..., Join]) -> None:
    rng = np.random.default_rng(0)
    session = synthetic_session("gen-a", rng)
    first, second = feedback("gen-a", "thumbs_up"), feedback("gen-a", "edit_kept", value=0.4)
    for event in (first, first, second):  # a duplicate, and two events for one generation
        producer.send(kafka.topics.feedback, event.generation_id, event)
    producer.flush()
    join = make_join()
    run_until(join, lambda: join.stats.feedback == 2)
    assert join.stats.experiences == 0  # no session yet
    producer.send(kafka.topics.sessions, session.generation_id, session).get(timeout=10)
    run_until(join, lambda: join.stats.experiences == 2)
    experiences = read_all(kafka, kafka.topics.experiences, ExperienceReady)
    by_event = {x.feedback_event_ids[0]: x for x in experiences}
    assert sorted(by_event) == sorted([first.event_id, second.event_id])
    assert by_event[first.event_id].reward == 1.0
    assert by_event[second.event_id].reward == pytest.approx(0.4)
    x = by_event[first.event_id]
    assert x.experience_id == experience_id_for(first.event_id)
    assert x.completion_token_ids == session.completion_token_ids
    assert x.logprobs == session.logprobs and x.routed_experts == session.routed_experts
    assert (x.generation_id, x.model_version, x.feedback_kind) == ("gen-a", 0, "thumbs_up")
    assert join.stats.duplicates == 1


@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
def test_unmatched_entries_expire_to_the_dlq(kafka: KafkaConfig, producer: EventProducer,
                                             make_join: Callable[..., Join],
                                             clock: Clock) -> None:
    lonely_feedback = feedback("gen-without-session")
    lonely_session = synthetic_session("gen-without-feedback", np.random.default_rng(1))
    producer.send(kafka.topics.feedback, lonely_feedback.generation_id, lonely_feedback)
    producer.send(kafka.topics.sessions, lonely_session.generation_id, lonely_session)
    producer.flush()
    join = make_join(expire_after_s=60, sweep_every_s=1)
    run_until(join, lambda: join.stats.feedback == 1 and join.stats.sessions == 1)
    clock.now += 61
    run_until(join, lambda: join.stats.expired_feedback == 1)
    assert join.stats.expired_sessions == 1
    letters = read_all(kafka, kafka.topics.dlq, DeadLetter)
    assert sorted(d.topic for d in letters) == sorted([kafka.topics.feedback,
                                                       kafka.topics.sessions])
    for letter in letters:
        assert letter.reason.startswith("unmatched") and "60s" in letter.reason
    [fb] = [d for d in letters if d.topic == kafka.topics.feedback]
    assert FeedbackReceived.model_validate_json(fb.raw()) == lonely_feedback
    # late session: the feedback stays expired, no experience
    producer.send(kafka.topics.sessions, "gen-without-session",
                  synthetic_session("gen-without-session", np.random.default_rng(2))).get(10)
    run_until(join, lambda: join.stats.sessions == 2)
    assert read_all(kafka, kafka.topics.experiences, ExperienceReady) == []


def test_undecodable_records_go_to_the_dlq_and_the_join_goes_on(
        kafka: KafkaConfig, producer: EventProducer, make_join: Callable[..., Join]) -> None:
    bad = [b"not json", b'{"event": "FeedbackReceived", "schema_version": 1}',
           b'{"event": "FeedbackReceived", "schema_version": 3, "event_id": "e",'
           b' "generation_id": "g", "kind": "accept"}']
    for raw in bad:
        producer.send_raw(kafka.topics.feedback, "g", raw)
    producer.send_raw(kafka.topics.sessions, "g", b"\x00\xff")
    good = feedback("gen-b")
    producer.send(kafka.topics.feedback, "gen-b", good)
    producer.send(kafka.topics.sessions, "gen-b", synthetic_session("gen-b",
                                                                    np.random.default_rng(3)))
    producer.flush()
    join = make_join()
    run_until(join, lambda: join.stats.experiences == 1 and join.stats.dead_letters == 4)
    letters = read_all(kafka, kafka.topics.dlq, DeadLetter)
    assert sorted(d.raw() for d in letters) == sorted([*bad, b"\x00\xff"])
    assert all(d.reason and d.consumer == "join" for d in letters)


@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
def test_a_crash_between_produce_and_commit_does_not_produce_twice(
        kafka: KafkaConfig, producer: EventProducer, make_join: Callable[..., Join]) -> None:
    events = [feedback("gen-c"), feedback("gen-c", "reject")]
    for event in events:
        producer.send(kafka.topics.feedback, "gen-c", event)
    session = synthetic_session("gen-c", np.random.default_rng(4))
    producer.send(kafka.topics.sessions, "gen-c", session)
    producer.flush()
    first = make_join()
    deliver = first.producer.deliver

    def die_after_the_first_ack(topic: str, records: object, *, timeout_s: float) -> object:
        if topic == kafka.topics.experiences:  # the broker has the first, SQL nothing of it
            deliver(topic, list(records)[:1], timeout_s=timeout_s)  # type: ignore[call-overload]
            raise RuntimeError("killed before the commit")
        return deliver(topic, records, timeout_s=timeout_s)  # type: ignore[arg-type]

    first.producer.deliver = die_after_the_first_ack  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="killed before the commit"):
        run_until(first, lambda: False)
    first.close()
    second = make_join()
    run_until(second, lambda: second.stats.experiences == 1, timeout_s=40)  # the other is there
    experiences = read_all(kafka, kafka.topics.experiences, ExperienceReady)
    assert sorted(x.experience_id for x in experiences) == sorted(
        experience_id_for(e.event_id) for e in events)
    for x in experiences:  # the one made again is the one the first would have made
        [e] = [e for e in events if e.event_id == x.feedback_event_ids[0]]
        expected = ExperienceReady.of(session, e, reward_for(e, second.settings.rewards))
        assert x.model_dump(exclude={"joined_at"}) == expected.model_dump(exclude={"joined_at"})


def test_sessions_and_feedback_of_a_generation_share_a_partition(
        kafka: KafkaConfig, producer: EventProducer) -> None:
    """The session log and the intake place a generation's records on one partition number,
    which the join's range assignment gives to one member."""
    from ingest.log import partition_for

    sessions = EventProducer(kafka, client_id="flywheel-session-log")
    try:
        for i in range(12):
            g = f"gen-p{i}-{uuid.uuid4().hex[:6]}"
            meta_s = sessions.send_raw(kafka.topics.sessions, g, b"{}").get(timeout=10)
            meta_f = producer.send_raw(kafka.topics.feedback, g, b"{}").get(timeout=10)
            expected = partition_for(g.encode(), producer.partitions(kafka.topics.feedback))
            assert meta_s.partition == meta_f.partition == expected
    finally:
        sessions.close()


@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
def test_the_sweep_matches_feedback_whose_session_another_member_stored(
        kafka: KafkaConfig, producer: EventProducer, make_join: Callable[..., Join],
        clock: Clock) -> None:
    """Two members can each store their half of a generation while its partition moves
    between them; the sweep joins the halves, once, even when both members sweep."""
    from ingest.join_store import SessionRow, add_sessions

    event = feedback("gen-r")
    producer.send(kafka.topics.feedback, "gen-r", event).get(timeout=10)
    first, second = make_join(), make_join()
    run_until(first, lambda: first.stats.feedback == 1)
    assert first.stats.experiences == 0
    session = synthetic_session("gen-r", np.random.default_rng(6))
    with second.db.begin() as conn:  # the other member stored the session, saw no feedback
        add_sessions(conn, [SessionRow("gen-r", session.model_dump_json(), clock(), False)], [])
    clock.now += 10  # past sweep_every_s: the next step sweeps
    first.step()
    second.step()
    assert first.stats.rematched + second.stats.rematched == 1
    experiences = read_all(kafka, kafka.topics.experiences, ExperienceReady)
    assert [x.feedback_event_ids for x in experiences] == [[event.event_id]]
    assert experiences[0].completion_token_ids == session.completion_token_ids


def test_the_tail_scan_reads_a_whole_last_batch(kafka: KafkaConfig,
                                                producer: EventProducer) -> None:
    """Tansu reports a partition's end as its last batch's first offset + 1: the scan that
    recovery relies on must still see every record of that batch."""
    from ingest.topic_reader import scan_keys

    topic = kafka.topics.experiences
    keys = [f"scan-{i}-{uuid.uuid4().hex[:6]}" for i in range(1200)]
    starts: dict[int, int] = {}
    for meta in producer.deliver(topic, [(k, b"{}") for k in keys], timeout_s=10):
        starts[meta.partition] = min(starts.get(meta.partition, meta.offset), meta.offset)
    assert scan_keys(kafka, topic, starts) >= set(keys)
    assert scan_keys(kafka, topic, starts, wanted=set(keys[:10])) >= set(keys[:10])
