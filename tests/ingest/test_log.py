"""The event log on a real broker: typed round trip, manual commits, DLQ for bad records."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic

from ingest.config import KafkaConfig
from ingest.events import DeadLetter, FeedbackReceived, encode
from ingest.log import EventConsumer, EventProducer, partition_for
from ingest.topic_reader import TopicReader, offset_key, read_all, read_raw


def feedback(i: int) -> FeedbackReceived:
    return FeedbackReceived(event_id=f"e{i}", generation_id=f"g{i}", kind="accept")


def drain(consumer: EventConsumer | TopicReader, want: int, polls: int = 30) -> list:
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


def test_topic_reader_starts_where_told_seeks_commits_and_skips_bad_records(
        kafka: KafkaConfig) -> None:
    """The reader of every partition of one topic, without a group join: from the beginning,
    from the end, or from a group's committed offsets; `seek` to stored offsets; a record that
    does not decode goes to the DLQ, named by the reader, and the reader goes on."""
    topic = kafka.topics.feedback
    producer = EventProducer(kafka)
    producer.send_raw(topic, "g0", b"not json")  # before e0, on its partition
    for i in range(4):  # one batch each: Tansu reports a batch's first offset + 1 as the end
        producer.flush()
        producer.send(topic, f"g{i}", feedback(i))
    producer.flush()

    beginning = TopicReader(kafka, topic, FeedbackReceived, dlq=producer, name="reader-test")
    got = drain(beginning, 4)
    assert sorted(d.event.event_id for d in got) == ["e0", "e1", "e2", "e3"]
    assert beginning.undecodable == 1 and beginning.caught_up()
    beginning.close()
    [letter] = [d for d in read_all(kafka, kafka.topics.dlq, DeadLetter)
                if d.consumer == "reader-test"]
    assert letter.raw() == b"not json" and letter.topic == topic

    end = TopicReader(kafka, topic, FeedbackReceived, start="end")
    assert end.poll(timeout_ms=300) == []
    producer.send(topic, "g4", feedback(4))
    producer.flush()
    assert [d.event.event_id for d in drain(end, 1)] == ["e4"]
    end.close()

    group = f"reader-{uuid.uuid4().hex[:6]}"
    first = TopicReader(kafka, topic, FeedbackReceived, start="committed", group_id=group)
    records = drain(first, 5)  # nothing committed yet: from the beginning
    assert len(records) == 5
    offsets = {offset_key(d.topic, d.partition): d.offset + 1 for d in records}
    assert first.lag({}) == 6 and first.lag(offsets) == 0  # the bad record is on the log too
    first.commit_offsets(offsets)
    first.close()

    producer.send(topic, "g5", feedback(5))
    producer.flush()
    again = TopicReader(kafka, topic, FeedbackReceived, start="committed", group_id=group)
    assert [d.event.event_id for d in drain(again, 1)] == ["e5"]
    again.seek({offset_key(topic, p): 0 for p in range(kafka.topics.partitions)})
    assert len(drain(again, 6)) == 6
    again.close()
    producer.close()


def test_deliver_lands_each_record_on_its_key_partition_in_order(kafka: KafkaConfig) -> None:
    topic = f"deliver-{uuid.uuid4().hex[:6]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    admin.create_topics([NewTopic(topic, 3, 1)])
    admin.close()
    producer = EventProducer(kafka)
    assert producer.partitions(topic) == 3
    events = [feedback(i) for i in range(300)]
    records = [(e.generation_id.encode(), encode(e)) for e in events]
    acked = producer.deliver(topic, records, timeout_s=10)
    assert [m.partition for m in acked] == [partition_for(k, 3) for k, _ in records]
    for partition in range(3):  # offsets follow the order of the call within a partition
        mine = [m.offset for m in acked if m.partition == partition]
        assert mine == sorted(mine) and len(set(mine)) == len(mine)
    producer.close()
    got = read_raw(kafka, topic)
    assert sorted(value for _, value in got) == sorted(value for _, value in records)
    # each record at the offset its metadata names (read back per partition, in order)
    consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in range(3)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        at: dict[tuple[int, int], bytes] = {}
        deadline = time.monotonic() + 30
        while len(at) < len(records) and time.monotonic() < deadline:
            for tp, recs in consumer.poll(timeout_ms=500).items():
                at.update(((tp.partition, r.offset), r.value) for r in recs)
    finally:
        consumer.close()
    assert all(at[(m.partition, m.offset)] == v for (_, v), m in zip(records, acked, strict=True))


def test_roundrobin_assignment_deals_a_topics_partitions_out_in_turn(kafka: KafkaConfig) -> None:
    """Two members of a "roundrobin" group over six partitions hold 0, 2, 4 and 1, 3, 5: work
    spread over consecutive partitions splits evenly (by range they would hold 0-2 and 3-5)."""
    topic = f"dealt-{uuid.uuid4().hex[:6]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    admin.create_topics([NewTopic(topic, 6, 1)])
    admin.close()
    group = f"test-{uuid.uuid4().hex[:6]}"
    members = [EventConsumer(kafka, group_id=group, types={topic: FeedbackReceived}, dlq=None,
                             assignment="roundrobin") for _ in range(2)]
    held: list[set[int]] = [set(), set()]
    dealt = threading.Event()

    def take_part(i: int) -> None:
        # each member polls without pause on a thread of its own, as a worker process does:
        # kafka-python 3.0 drops a JoinGroup that completes between two of a member's polls
        # and joins again, so two members taking turns on one thread can rejoin forever
        deadline = time.monotonic() + 60
        while not dealt.is_set() and time.monotonic() < deadline:
            members[i].poll(timeout_ms=200)
            held[i] = {tp.partition for tp in members[i].assignment()}

    try:
        with ThreadPoolExecutor(len(members)) as pool:
            polling = [pool.submit(take_part, i) for i in range(len(members))]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and sorted(len(h) for h in held) != [3, 3]:
                time.sleep(0.1)
            dealt.set()
            for done in polling:
                done.result()
        assert sorted(held, key=min) == [{0, 2, 4}, {1, 3, 5}]
    finally:
        for member in members:
            member.close()


def test_a_member_the_group_moved_on_from_commits_nothing_and_gets_its_records_again(
        kafka: KafkaConfig) -> None:
    """A member too slow between polls (a rollout batch, say) is dropped by its group: its
    commit is refused without raising, and the records come again (at least once)."""
    topic = f"slow-{uuid.uuid4().hex[:6]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    admin.create_topics([NewTopic(topic, 1, 1)])
    admin.close()
    producer = EventProducer(kafka)
    for i in range(3):
        producer.send(topic, f"g{i}", feedback(i))
    producer.flush()
    producer.close()
    consumer = EventConsumer(kafka, group_id=f"test-{uuid.uuid4().hex[:6]}",
                             types={topic: FeedbackReceived}, dlq=None,
                             max_poll_interval_ms=1000)
    try:
        first = drain(consumer, 3)
        assert len(first) == 3
        time.sleep(4)  # past max_poll_interval_ms: the heartbeat thread leaves the group
        assert consumer.commit() is False
        again = drain(consumer, 3)
        assert sorted(d.event.event_id for d in again) == ["e0", "e1", "e2"]
        assert consumer.commit() is True
    finally:
        consumer.close()
