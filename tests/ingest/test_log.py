"""The event log on a real broker: typed round trip, manual commits, DLQ for bad records."""

from __future__ import annotations

import uuid

from kafka import KafkaAdminClient
from kafka.admin import NewTopic

from ingest.config import KafkaConfig
from ingest.events import DeadLetter, FeedbackReceived, encode
from ingest.log import EventConsumer, EventProducer, partition_for, read_all, read_raw


def feedback(i: int) -> FeedbackReceived:
    return FeedbackReceived(event_id=f"e{i}", generation_id=f"g{i}", kind="accept")


def drain(consumer: EventConsumer, want: int, polls: int = 30) -> list:
    got: list = []
    for _ in range(polls):
        got.extend(consumer.poll(timeout_ms=500))
        if len(got) >= want:
            break
    return got


def test_consumer_decodes_commits_and_dead_letters(kafka: KafkaConfig) -> None:
    producer = EventProducer(kafka)
    for i in range(5):
        producer.send(kafka.topics.feedback, f"g{i}", feedback(i))
    producer.send_raw(kafka.topics.feedback, "bad", b'{"event": "FeedbackReceived"}')
    producer.flush()
    group = f"test-{uuid.uuid4().hex[:6]}"
    consumer = EventConsumer(kafka, group_id=group, types={kafka.topics.feedback:
                                                           FeedbackReceived}, dlq=producer)
    got = drain(consumer, 5)
    assert sorted(d.event.event_id for d in got) == [f"e{i}" for i in range(5)]
    assert consumer.dead_letters == 1
    consumer.commit()
    consumer.close()

    letters = read_all(kafka, kafka.topics.dlq, DeadLetter)
    assert len(letters) == 1
    assert letters[0].raw() == b'{"event": "FeedbackReceived"}'
    assert "event_id" in letters[0].reason

    # Committed offsets hold: the same group sees only what came after.
    producer.send(kafka.topics.feedback, "g9", feedback(9))
    producer.flush()
    again = EventConsumer(kafka, group_id=group, types={kafka.topics.feedback:
                                                        FeedbackReceived}, dlq=producer)
    assert [d.event.event_id for d in drain(again, 1)] == ["e9"]
    again.close()
    producer.close()


def test_send_many_lands_each_record_on_its_partition_in_order(kafka: KafkaConfig) -> None:
    topic = f"send-many-{uuid.uuid4().hex[:6]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    admin.create_topics([NewTopic(topic, 3, 1)])
    admin.close()
    producer = EventProducer(kafka)
    assert producer.partitions(topic) == 3
    events = [feedback(i) for i in range(300)]
    records = [(partition_for(e.generation_id.encode(), 3), e.generation_id.encode(), encode(e))
               for e in events]
    futures = producer.send_many(topic, records)
    producer.flush()
    acks = [f.get(timeout=10) for f in futures]
    assert [a.partition for a in acks] == [p for p, _, _ in records]
    for partition in range(3):  # offsets follow the order of the call within a partition
        offsets = [a.offset for a in acks if a.partition == partition]
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    producer.close()
    got = read_raw(kafka, topic)
    assert sorted(value for _, value in got) == sorted(value for _, _, value in records)
