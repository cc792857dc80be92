"""The Kafka event log: typed producer, typed group consumer with manual commits, DLQ; the
typed reader of a whole topic is ingest/topic_reader.py. The one seam to Kafka: no module
outside ingest/ imports the Kafka client (tests/test_layers.py checks it); they use these
classes and `BrokerError`.

Delivery is at-least-once everywhere (Tansu has no transactions, and idempotent processing
holds on any Kafka): producers use acks=all + idempotence + zstd; consumers commit only after
the caller has stored what depends on the records; a record that does not decode goes to the
`dlq` topic with the reason and its raw bytes, and the consumer keeps going.
"""

from __future__ import annotations

import logging
import random
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from kafka import (
    ConsumerRebalanceListener,
    KafkaAdminClient,
    KafkaConsumer,
    KafkaProducer,
    TopicPartition,
)
from kafka.admin import NewTopic
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from kafka.errors import (
    CommitFailedError,
    KafkaError,
    KafkaTimeoutError,
    TopicAlreadyExistsError,
)
from kafka.partitioner.abc import Partitioner
from pydantic import BaseModel, TypeAdapter, ValidationError

from ingest.config import KafkaConfig
from ingest.events import DeadLetter, EventDecodeError, decode, encode

log = logging.getLogger(__name__)
E = TypeVar("E", bound=BaseModel)
# what the Kafka client raises when a broker is away or refuses: callers outside ingest/
# catch this name (the client is ingest's to hold)
BrokerError = KafkaError


def ensure_topics(config: KafkaConfig) -> list[str]:
    """Create every Flywheel topic that does not exist yet; return the ones created."""
    admin = KafkaAdminClient(bootstrap_servers=config.bootstrap,
                             request_timeout_ms=config.request_timeout_ms)
    try:
        existing = set(admin.list_topics())
        topics = config.topics
        wanted = [NewTopic(name, topics.partitions, topics.replication_factor,
                           topic_configs={"cleanup.policy": "compact,delete"}
                           if name in topics.compacted else {})
                  for name in topics.names() if name not in existing]
        if wanted:
            try:
                admin.create_topics(wanted)
            except TopicAlreadyExistsError:
                pass  # another process created them between list and create: fine
        return [t.name for t in wanted]
    finally:
        admin.close()


def partition_for(key: bytes, partitions: int) -> int:
    """A stable partition for `key` (CRC-32: the same key always lands on the same partition).

    Every Flywheel producer partitions by it (`Crc32Partitioner`), so `sessions` and
    `feedback`, both keyed by generation_id and created with the same partition count, are
    co-partitioned: a generation's session and its feedback share a partition number, and the
    join's range assignment hands both to the same member. Cheaper than kafka-python's murmur2
    (written in Python).
    """
    return zlib.crc32(key) % partitions


class Crc32Partitioner(Partitioner):
    """kafka-python's partitioner interface over `partition_for`; unkeyed records go to any
    available partition, as with the default partitioner."""

    def partition(self, topic: str, key: Any, serialized_key: bytes | None, value: Any,
                  serialized_value: bytes | None, cluster: Any) -> int:
        all_partitions = sorted(cluster.partitions_for_topic(topic) or ())
        if not all_partitions:
            raise ValueError(f"topic {topic!r} has no partitions in the metadata")
        if serialized_key is None:
            available = list(cluster.available_partitions_for_topic(topic))
            return random.choice(available or all_partitions)
        return all_partitions[partition_for(serialized_key, len(all_partitions))]


class EventProducer:
    """Sends pydantic events as JSON, keyed, with acks=all, idempotence and zstd: the one
    producer seam of Flywheel (the session log, the feedback intake, the join, the release
    pipeline), over kafka-python's public API.

    `send` queues one record and returns kafka-python's future; `deliver` sends many and
    waits until the broker acknowledged each one. Batches hold up to `batch_size` bytes per
    partition, so records queued together travel in one batch per partition.
    """

    def __init__(self, config: KafkaConfig, *, client_id: str = "flywheel",
                 batch_size: int = 256 * 1024) -> None:
        self.config = config
        self._partitions: dict[str, int] = {}
        self._producer = KafkaProducer(
            bootstrap_servers=config.bootstrap, client_id=client_id, acks="all",
            enable_idempotence=True, compression_type="zstd", linger_ms=config.linger_ms,
            batch_size=batch_size, partitioner=Crc32Partitioner(),
            request_timeout_ms=config.request_timeout_ms,
            delivery_timeout_ms=config.delivery_timeout_ms,
            max_block_ms=config.request_timeout_ms,
            # give up on an unreachable broker after the request timeout, not 30 s
            bootstrap_timeout_ms=config.request_timeout_ms)

    def send(self, topic: str, key: str | bytes | None, event: BaseModel) -> Any:
        """Queue one event; returns kafka-python's future (`.get()` waits for the ack)."""
        return self.send_raw(topic, key, encode(event))

    def send_raw(self, topic: str, key: str | bytes | None, value: bytes | None, *,
                 partition: int | None = None) -> Any:
        """Queue one record (partition None: `Crc32Partitioner`'s choice; value None: a
        tombstone, which compaction turns into the removal of the key's records)."""
        key_bytes = key.encode("utf-8") if isinstance(key, str) else key
        return self._producer.send(topic, key=key_bytes, value=value, partition=partition)

    def deliver(self, topic: str, records: Iterable[tuple[str | bytes, bytes | None]], *,
                timeout_s: float) -> list[Any]:
        """Send (key, value) records and wait until the broker has acknowledged every one;
        returns their RecordMetadata (partition, offset), in order. Raises the broker's error
        for the first that failed, KafkaTimeoutError past `timeout_s`: the caller retries,
        and consumers dedupe the copies by key. Each record's partition is computed here
        (`partition_for`, what `Crc32Partitioner` gives), which spares kafka-python's
        partitioner call per record."""
        count = self.partitions(topic)
        futures = []
        for key, value in records:
            key_bytes = key.encode("utf-8") if isinstance(key, str) else key
            futures.append(self.send_raw(topic, key_bytes, value,
                                         partition=partition_for(key_bytes, count)))
        self.flush(timeout_s)  # no linger: the records sent together are the batch
        return [future.get(timeout=0) for future in futures]

    def partitions(self, topic: str) -> int:
        """How many partitions `topic` has (asked once, then remembered)."""
        count = self._partitions.get(topic)
        if count is None:
            found = self._producer.partitions_for(topic)
            if not found:
                raise RuntimeError(f"topic {topic!r} has no partitions")
            count = self._partitions[topic] = len(found)
        return count

    def flush(self, timeout_s: float | None = None) -> None:
        self._producer.flush(timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self._producer.close(timeout=timeout_s)

    def abandon(self) -> None:
        """Let go of this producer without waiting: a background thread closes it once what
        it holds is acknowledged or expired (`_close_once_drained`; records in flight to a
        broker that does not answer can outlast one delivery timeout). For a producer
        whose batches expired: the idempotent producer does not recover from that, even once
        the broker is back, so its owner makes a new one."""
        threading.Thread(target=self._close_once_drained, name="producer-close",
                         daemon=True).start()

    def _close_once_drained(self) -> None:
        """Close, trying again each delivery timeout while records are still in flight to a
        broker that does not answer: kafka-python's `close` raises when its flush times out
        and leaves the producer's sender thread running."""
        timeout_s = self.config.delivery_timeout_ms / 1000
        while True:
            try:
                self._producer.close(timeout=timeout_s)
                return
            except KafkaTimeoutError:
                log.info("an abandoned producer still has records in flight; closing it "
                         "again in %.0f s", timeout_s)


@dataclass(frozen=True)
class Delivered(Generic[E]):
    """One decoded record with where it came from (for commits and dedupe) and its bytes."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    event: E
    raw: bytes = field(default=b"", repr=False, compare=False)


_LIST_ADAPTERS: dict[type[BaseModel], TypeAdapter[Any]] = {}


def list_adapter(event_type: type[E]) -> TypeAdapter[list[E]]:
    """pydantic's validator of a JSON array of `event_type` (built once per type)."""
    adapter = _LIST_ADAPTERS.get(event_type)
    if adapter is None:
        adapter = _LIST_ADAPTERS[event_type] = TypeAdapter(list[event_type])  # type: ignore[valid-type]
    return adapter


def decode_all(event_type: type[E], raws: Sequence[bytes]) -> list[E | EventDecodeError]:
    """Decode many records: one pydantic call over them as a JSON array when all are valid
    (the common case), else one by one so each bad record gets its own error."""
    if len(raws) > 1:
        try:
            events: list[E] = list_adapter(event_type).validate_json(
                b"[" + b",".join(raws) + b"]")
        except ValidationError:
            pass
        else:
            if len(events) == len(raws):  # a record holding two values would shift the rest
                return list(events)
    out: list[E | EventDecodeError] = []
    for raw in raws:
        try:
            out.append(decode(event_type, raw))
        except EventDecodeError as exc:
            out.append(exc)
    return out


@dataclass(frozen=True)
class Undecodable:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    raw: bytes
    reason: str


def decode_polled(batches: Mapping[TopicPartition, Sequence[Any]],
                   types: Mapping[str, type[BaseModel]]
                   ) -> tuple[list[Delivered[Any]], list[Undecodable]]:
    """kafka-python's poll result decoded: the records that decode, and those that do not."""
    out: list[Delivered[Any]] = []
    bad: list[Undecodable] = []
    for tp, batch in batches.items():
        records = [rec for rec in batch if rec.value is not None]  # tombstones carry no event
        raws = [rec.value for rec in records]
        for rec, raw, event in zip(records, raws, decode_all(types[tp.topic], raws),
                                   strict=True):
            if isinstance(event, EventDecodeError):
                bad.append(Undecodable(tp.topic, tp.partition, rec.offset, rec.key, raw,
                                        str(event)))
            else:
                out.append(Delivered(tp.topic, tp.partition, rec.offset, rec.key, event, raw))
    return out, bad


def send_dead_letters(dlq: EventProducer | None, config: KafkaConfig,
                       letters: Sequence[Undecodable], consumer: str) -> int:
    """Each undecodable record to the `dlq` topic with its reason, waiting for the acks
    (without a DLQ producer, each is logged and skipped); returns how many were sent."""
    futures = []
    for bad in letters:
        log.warning("%s %s@%d:%d %s", "dlq" if dlq is not None else "skipped undecodable",
                    bad.topic, bad.partition, bad.offset, bad.reason)
        if dlq is not None:
            futures.append(dlq.send(config.topics.dlq, bad.key, DeadLetter.of(
                topic=bad.topic, partition=bad.partition, offset=bad.offset, key=bad.key,
                raw=bad.raw, reason=bad.reason, consumer=consumer)))
    for future in futures:
        future.get(timeout=config.delivery_timeout_ms / 1000)
    return len(futures)


class _Hooks(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, consumer: EventConsumer) -> None:
        self.consumer = consumer

    def on_partitions_revoked(self, revoked: Any) -> None:
        for hook in self.consumer.on_revoked:
            hook(set(revoked))

    def on_partitions_assigned(self, assigned: Any) -> None:
        for hook in self.consumer.on_assigned:
            hook(set(assigned))


class EventConsumer:
    """A group consumer over several topics, each decoded into its own event type.

    `poll()` returns decoded records and sends undecodable ones to the DLQ (waiting for the
    DLQ ack before they count as handled); `commit()` commits what `poll()` returned.
    `on_assigned` / `on_revoked` hooks run inside `poll()` when the group rebalances.
    `assignment`: how the group shares partitions. "range" (default) gives partition p of every
    topic to the same member, which keeps co-partitioned topics (sessions, feedback) together;
    "roundrobin" deals one topic's partitions out in turn (0, 2, 4 to one of two members),
    for work spread over consecutive partitions. Every member of a group must use the same.
    `options` go to `KafkaConsumer` (say, `fetch_max_wait_ms` for a latency-bound consumer).
    """

    def __init__(self, config: KafkaConfig, *, group_id: str,
                 types: Mapping[str, type[BaseModel]], dlq: EventProducer | None,
                 name: str | None = None, auto_offset_reset: str = "earliest",
                 max_poll_records: int = 500,
                 assignment: Literal["range", "roundrobin"] = "range", **options: Any) -> None:
        self.config = config
        self.types = dict(types)
        self.name = name or group_id
        self._dlq = dlq
        self.on_assigned: list[Callable[[set[TopicPartition]], None]] = []
        self.on_revoked: list[Callable[[set[TopicPartition]], None]] = []
        self._consumer = KafkaConsumer(
            bootstrap_servers=config.bootstrap, group_id=group_id,
            enable_auto_commit=False, auto_offset_reset=auto_offset_reset,
            session_timeout_ms=config.session_timeout_ms,
            heartbeat_interval_ms=config.heartbeat_interval_ms,
            request_timeout_ms=max(config.request_timeout_ms, config.session_timeout_ms + 5000),
            max_poll_records=max_poll_records,
            partition_assignment_strategy=(RangePartitionAssignor if assignment == "range"
                                           else RoundRobinPartitionAssignor,), **options)
        self._consumer.subscribe(list(self.types), listener=_Hooks(self))
        self.dead_letters = 0

    def poll(self, timeout_ms: int = 1000) -> list[Delivered[Any]]:
        delivered, letters = decode_polled(self._consumer.poll(timeout_ms=timeout_ms),
                                            self.types)
        if letters and self._dlq is None:
            raise EventDecodeError("; ".join(f"{b.topic}@{b.partition}:{b.offset}: {b.reason}"
                                             for b in letters))
        self.dead_letters += send_dead_letters(self._dlq, self.config, letters, self.name)
        return delivered

    def commit(self) -> bool:
        """Commit what was polled. False when the group had given the partitions to another
        member meanwhile (a rebalance, a member too slow between polls: `CommitFailedError`):
        their records go to their new owner again, as at-least-once delivery allows, and this
        member goes on with what the group gives it now."""
        try:
            self._consumer.commit()
        except CommitFailedError as exc:
            log.warning("%s: commit refused, the group moved on (%s): the records since the "
                        "last commit are delivered again", self.name, exc)
            return False
        return True

    def pause(self, partitions: set[TopicPartition]) -> None:
        self._consumer.pause(*partitions)

    def resume(self, partitions: set[TopicPartition] | None = None) -> None:
        """Resume `partitions` (default: every assigned one)."""
        self._consumer.resume(*(self._consumer.assignment() if partitions is None
                                else partitions))

    def assignment(self) -> set[TopicPartition]:
        return set(self._consumer.assignment())

    def close(self) -> None:
        self._consumer.close()
