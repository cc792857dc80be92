"""Session verdicts in the join: turn order and discounted rewards (pure), and on the real broker
and real SQL state: a verdict waits for its generations and its settle time, becomes one
experience per turn once, survives a crash between produce and mark, is expanded by one member
only, and expires to the DLQ when its session never shows up."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from bench.feedback import synthetic_session
from ingest.config import KafkaConfig
from ingest.events import (
    DeadLetter,
    ExperienceReady,
    FeedbackReceived,
    GenerationLogged,
    experience_id_for,
)
from ingest.feedback_rewards import turn_rewards
from ingest.join import Join
from ingest.join_sessions import Turn, covered_turns, turn_plan
from ingest.log import EventProducer
from ingest.topic_reader import read_all
from tests.ingest.conftest import Clock
from tests.ingest.helpers import produce, run_until

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def turn(generation_id: str, session_id: str | None, seconds: float,
         seed: int = 0) -> GenerationLogged:
    """A generation of `session_id`, generated `seconds` after T0."""
    session = synthetic_session(generation_id, np.random.default_rng(seed))
    return session.model_copy(update={"session_id": session_id,
                                      "created_at": T0 + timedelta(seconds=seconds)})


def verdict(session_id: str, kind: str = "accept", seconds: float = 100.0,
            **fields: object) -> FeedbackReceived:
    return FeedbackReceived(event_id=f"v-{uuid.uuid4().hex}", session_id=session_id,
                            kind=kind, occurred_at=T0 + timedelta(seconds=seconds),
                            **fields)  # type: ignore[arg-type]


def test_turns_are_ordered_by_generation_time_then_id() -> None:
    gens = [turn("g-c", "s", 20), turn("g-b", "s", 10), turn("g-a", "s", 10), turn("g-0", "s", 0)]
    late = turn("g-late", "s", 300)  # generated after the verdict: not judged by it
    ordered = covered_turns(verdict("s", seconds=100), [*gens, late])
    assert [g.generation_id for g in ordered] == ["g-0", "g-a", "g-b", "g-c"]
    # a time without a zone is read as UTC, not refused (nor compared with an aware one)
    naive = verdict("s", seconds=0).model_copy(update={"occurred_at": T0.replace(tzinfo=None)})
    assert [g.generation_id for g in covered_turns(naive, gens)] == ["g-0"]
    assert covered_turns(verdict("s", seconds=-1), gens) == []


def test_turn_rewards_are_discounted_back_from_the_outcome() -> None:
    assert turn_rewards(1.0, 3, 0.5) == [0.25, 0.5, 1.0]
    assert turn_rewards(-0.5, 4, 1.0) == [-0.5] * 4  # the default: every turn shares it
    assert turn_rewards(2.0, 1, 0.1) == [2.0]
    assert turn_rewards(1.0, 0, 0.5) == []
    plan = turn_plan(verdict("s"), [turn("g2", "s", 2), turn("g1", "s", 1)], -1.0, 0.5)
    assert [(g.generation_id, t, r) for g, t, r in plan] == [
        ("g1", Turn(0, 2), -0.5), ("g2", Turn(1, 2), -1.0)]


def experiences(kafka: KafkaConfig) -> list[ExperienceReady]:
    return sorted(read_all(kafka, kafka.topics.experiences, ExperienceReady),
                  key=lambda x: x.turn if x.turn is not None else -1)


@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
def test_a_verdict_waits_to_settle_then_judges_each_turn_once(
        kafka: KafkaConfig, producer: EventProducer, make_join: Callable[..., Join],
        clock: Clock) -> None:
    session_id = f"s-{uuid.uuid4().hex[:8]}"
    v = verdict(session_id, "thumbs_down", seconds=100)
    produce(producer, kafka, v)  # the verdict first: the sessions log may lag it
    join = make_join(session_discount=0.5, expire_after_s=60, sweep_every_s=1)
    run_until(join, lambda: join.stats.verdicts == 1)
    clock.now += 5  # settled, but no generation of the session is stored: it stays pending
    join.step()
    assert join.stats.verdicts_expanded == 0
    turns = [turn(f"g{k}-{session_id}", session_id, 10 * (3 - k), seed=k) for k in range(3)]
    other = turn(f"g-other-{session_id}", "another-session", 5)
    late = turn(f"g-late-{session_id}", session_id, 200)  # after the verdict
    produce(producer, kafka, *turns, other, late)
    run_until(join, lambda: join.stats.sessions == 5)
    clock.now += 1  # the next sweep retries it
    run_until(join, lambda: join.stats.verdicts_expanded == 1 and join.stats.experiences == 3)

    got = experiences(kafka)
    in_order = list(reversed(turns))  # generated at 0, 10, 20 s
    assert [x.generation_id for x in got] == [g.generation_id for g in in_order]
    assert [x.reward for x in got] == [-0.25, -0.5, -1.0]
    for k, (x, g) in enumerate(zip(got, in_order, strict=True)):
        assert (x.session_id, x.turn, x.turns, x.feedback_event_ids) == (
            session_id, k, 3, [v.event_id])
        assert x.experience_id == experience_id_for(v.event_id, g.generation_id)
        assert (x.completion_token_ids, x.logprobs, x.routed_experts) == (
            g.completion_token_ids, g.logprobs, g.routed_experts)

    produce(producer, kafka, v)  # re-delivered: nothing changes
    run_until(join, lambda: join.stats.duplicates == 1)
    clock.now += 61  # the judged turns count as matched: only the others expire as unjudged
    run_until(join, lambda: join.stats.expired_sessions == 2)
    letters = read_all(kafka, kafka.topics.dlq, DeadLetter)
    assert sorted(GenerationLogged.model_validate_json(d.raw()).generation_id
                  for d in letters) == sorted([other.generation_id, late.generation_id])
    assert len(experiences(kafka)) == 3 and join.stats.verdicts_expanded == 1


@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
def test_a_verdict_without_generations_expires_to_the_dlq(
        kafka: KafkaConfig, producer: EventProducer, make_join: Callable[..., Join],
        clock: Clock) -> None:
    v = verdict("s-nobody-logged", "accept")
    produce(producer, kafka, v)
    join = make_join(expire_after_s=60, sweep_every_s=1)
    run_until(join, lambda: join.stats.verdicts == 1)
    for _ in range(3):  # retried by every sweep meanwhile
        clock.now += 10
        join.step()
    assert join.stats.verdicts_expanded == 0 and join.stats.expired_verdicts == 0
    clock.now += 61
    run_until(join, lambda: join.stats.expired_verdicts == 1)
    [letter] = read_all(kafka, kafka.topics.dlq, DeadLetter)
    assert letter.topic == kafka.topics.feedback and letter.consumer == "join"
    assert letter.reason == "unmatched: no generation of session s-nobody-logged within 60s"
    assert FeedbackReceived.model_validate_json(letter.raw()) == v
    produce(producer, kafka, turn("g-too-late", "s-nobody-logged", 1))  # stays expired
    run_until(join, lambda: join.stats.sessions == 1)
    clock.now += 10
    join.step()
    assert join.stats.verdicts_expanded == 0
    assert read_all(kafka, kafka.topics.experiences, ExperienceReady) == []


@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
def test_two_members_never_both_expand_a_verdict(
        kafka: KafkaConfig, producer: EventProducer, make_join: Callable[..., Join],
        clock: Clock) -> None:
    """While a partition moves, its old and its new owner may both find a verdict due: the
    claim in SQL gives it to one of them."""
    v = verdict("s-two", "accept")
    produce(producer, kafka, v, turn("g-two-0", "s-two", 0), turn("g-two-1", "s-two", 1))
    first = make_join()
    run_until(first, lambda: first.stats.verdicts == 1 and first.stats.sessions == 2)
    first.step()
    assert first.stats.verdicts_expanded == 0  # stored less than session_settle_s ago
    second = make_join()
    clock.now += 3
    everything = range(first.producer.partitions(kafka.topics.feedback))
    assert second.expand_verdicts(everything) == (1, 2)
    assert first.expand_verdicts(everything) == (0, 0)
    first.expand_verdicts()
    assert first.stats.verdicts_expanded == 0
    got = experiences(kafka)
    assert [(x.generation_id, x.turn) for x in got] == [("g-two-0", 0), ("g-two-1", 1)]


@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
def test_a_crash_between_produce_and_commit_does_not_produce_a_turn_twice(
        kafka: KafkaConfig, producer: EventProducer, make_join: Callable[..., Join],
        clock: Clock) -> None:
    turns = [turn(f"g-crash-{k}", "s-crash", k, seed=k) for k in range(3)]
    v = verdict("s-crash", "reject")
    produce(producer, kafka, *turns, v)
    first = make_join()
    deliver = first.producer.deliver

    def die_after_the_middle_turn(topic: str, records: object, *, timeout_s: float) -> object:
        if topic == kafka.topics.experiences:  # the broker has one turn, SQL nothing of it
            deliver(topic, list(records)[1:2], timeout_s=timeout_s)  # type: ignore[call-overload]
            raise RuntimeError("killed before the commit")
        return deliver(topic, records, timeout_s=timeout_s)  # type: ignore[arg-type]

    first.producer.deliver = die_after_the_middle_turn  # type: ignore[method-assign]
    run_until(first, lambda: first.stats.verdicts == 1 and first.stats.sessions == 3)
    clock.now += 3
    with pytest.raises(RuntimeError, match="killed before the commit"):
        run_until(first, lambda: False)
    first.close()
    second = make_join()
    run_until(second, lambda: second.stats.verdicts_expanded == 1, timeout_s=40)
    assert second.stats.experiences == 2  # the middle turn was on the topic already
    got = experiences(kafka)
    assert sorted(x.experience_id for x in got) == sorted(
        experience_id_for(v.event_id, g.generation_id) for g in turns)
    for k, x in enumerate(got):  # each as the first would have made it
        expected = ExperienceReady.of(turns[k], v, -1.0, turn=k, turns=3)
        assert x.model_dump(exclude={"joined_at"}) == expected.model_dump(exclude={"joined_at"})
