"""The join's in-memory outbox on the real broker: rounds of whole outbox batches, marks only
for what the broker acked, oldest round first."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import numpy as np

from ingest.config import KafkaConfig
from ingest.events import FeedbackReceived, experience_id_for
from ingest.experience_json import joined_at_member, session_members
from ingest.join_outbox import Match, Outbox, Outgoing
from ingest.log import EventProducer, partition_for, read_raw
from tests.ingest.test_join import synthetic_session


def outgoing(source: int, seq: int, count: int) -> list[Outgoing]:
    """`count` experiences of outbox batch (`source`, `seq`), one generation."""
    generation = f"gen-{uuid.uuid4().hex[:8]}"
    session = synthetic_session(generation, np.random.default_rng(seq))
    match = Match(session, session_members(session), matched=True)
    joined = joined_at_member(datetime(2026, 1, 1, tzinfo=UTC))
    rows = []
    for _ in range(count):
        f = FeedbackReceived(event_id=f"e-{uuid.uuid4().hex}", generation_id=generation,
                             kind="accept")
        rows.append(Outgoing(source, seq, experience_id_for(f.event_id), (match, f, 1.0, joined)))
    return rows


def test_rounds_hold_whole_batches_and_are_marked_once_acked(
        kafka: KafkaConfig, producer: EventProducer) -> None:
    topic = kafka.topics.experiences
    outbox = Outbox(producer, topic, timeout_s=10, chunk=3, max_in_flight=1)
    first, second, other = outgoing(0, 1, 2), outgoing(0, 2, 3), outgoing(1, 1, 1)
    outbox.add(first + second + other)
    # chunk 3 ends inside batch (0, 2): the round takes the whole batch, then (1, 1) is a
    # second round, sent after the first was acked (max_in_flight=1)
    outbox.send()
    assert outbox.produced == 5 and outbox.marks.seqs == {0: 2}
    outbox.settle(block=True)
    assert not outbox.in_flight and outbox.produced == 6
    marks = outbox.take_marks()
    assert marks.seqs == {0: 2, 1: 1} and not outbox.marks
    partitions = producer.partitions(topic)
    keys = [(key or b"").decode() for key, _ in read_raw(kafka, topic, quiet_ms=200)]
    assert sorted(keys) == sorted(row.experience_id for row in first + second + other)
    for (source, partition), offset in marks.offsets.items():
        assert source in (0, 1) and 0 <= partition < partitions and offset >= 0
    assert {(0, partition_for(row.experience_id.encode(), partitions))
            for row in first + second} <= set(marks.offsets)


def test_experiences_a_predecessor_produced_are_marked_not_sent(
        kafka: KafkaConfig, producer: EventProducer) -> None:
    topic = kafka.topics.experiences
    outbox = Outbox(producer, topic, timeout_s=10)
    rows = outgoing(2, 7, 3)
    rows[0].produce = False
    outbox.add(rows)
    outbox.send()
    outbox.settle(block=True)
    assert outbox.produced == 2 and outbox.take_marks().seqs == {2: 7}
    keys = {(key or b"").decode() for key, _ in read_raw(kafka, topic, quiet_ms=200)}
    assert keys == {row.experience_id for row in rows[1:]}
