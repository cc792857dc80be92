"""The Kafka event log: typed producer, typed group consumer with manual commits, typed
reader of a whole topic, DLQ. The one seam to Kafka: no module outside ingest/ imports the
Kafka client (tests/test_layers.py checks it); they use these classes and `BrokerError`.

Delivery is at-least-once everywhere (Tansu has no transactions, and idempotent processing
holds on any Kafka): producers use acks=all + idempotence + zstd; consumers commit only after
the caller has stored what depends on the records; a record that does not decode goes to the
`dlq` topic with the reason and its raw bytes, and the consumer keeps going.
"""

from __future__ import annotations

import logging
import random
import threading
import time
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
from kafka.errors import KafkaError, KafkaTimeoutError, TopicAlreadyExistsError
from kafka.partitioner.abc import Partitioner
from kafka.structs import OffsetAndMetadata
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
        wanted = [NewTopic(name, config.topics.partitions, config.topics.replication_factor)
                  for name in config.topics.names() if name not in existing]
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

    def send_raw(self, topic: str, key: str | bytes | None, value: bytes, *,
                 partition: int | None = None) -> Any:
        """Queue one record (partition None: `Crc32Partitioner`'s choice)."""
        key_bytes = key.encode("utf-8") if isinstance(key, str) else key
        return self._producer.send(topic, key=key_bytes, value=value, partition=partition)

    def deliver(self, topic: str, records: Iterable[tuple[str | bytes, bytes]], *,
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
class _Undecodable:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    raw: bytes
    reason: str


def _decode_polled(batches: Mapping[TopicPartition, Sequence[Any]],
                   types: Mapping[str, type[BaseModel]]
                   ) -> tuple[list[Delivered[Any]], list[_Undecodable]]:
    """kafka-python's poll result decoded: the records that decode, and those that do not."""
    out: list[Delivered[Any]] = []
    bad: list[_Undecodable] = []
    for tp, records in batches.items():
        raws = [rec.value or b"" for rec in records]
        for rec, raw, event in zip(records, raws, decode_all(types[tp.topic], raws),
                                   strict=True):
            if isinstance(event, EventDecodeError):
                bad.append(_Undecodable(tp.topic, tp.partition, rec.offset, rec.key, raw,
                                        str(event)))
            else:
                out.append(Delivered(tp.topic, tp.partition, rec.offset, rec.key, event, raw))
    return out, bad


def _send_dead_letters(dlq: EventProducer | None, config: KafkaConfig,
                       letters: Sequence[_Undecodable], consumer: str) -> int:
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
        delivered, letters = _decode_polled(self._consumer.poll(timeout_ms=timeout_ms),
                                            self.types)
        if letters and self._dlq is None:
            raise EventDecodeError("; ".join(f"{b.topic}@{b.partition}:{b.offset}: {b.reason}"
                                             for b in letters))
        self.dead_letters += _send_dead_letters(self._dlq, self.config, letters, self.name)
        return delivered

    def commit(self) -> None:
        self._consumer.commit()

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


Offsets = dict[str, int]  # "topic:partition" -> the next offset to read


def offset_key(topic: str, partition: int) -> str:
    """How `Offsets` name a partition (a JSON object key, so a checkpoint can hold them)."""
    return f"{topic}:{partition}"


class TopicReader(Generic[E]):
    """Every partition of one topic, assigned by hand, records decoded as `event_type`.

    No group join (nothing to wait for after a restart, no member steals another's records),
    so each reader sees the whole topic. It starts at `start`: "beginning" (a follower that
    rebuilds its state from the topic: a replica's releases, the console's tally), "end"
    (what comes after now: the bootstrap's rollout groups; Tansu reports the end of a
    partition as its last batch's first offset + 1, so there the rest of that batch too) or
    "committed" (the offsets
    `group_id` committed, else the beginning); `seek` moves it to stored offsets (the online
    trainer's checkpoint). With `group_id`, `commit_offsets` records its progress under that
    group, which lag readers (ingest/offsets.py) see, without joining it. A record that does
    not decode goes to the DLQ with `dlq`, else is logged and skipped; either way it is
    counted in `undecodable`. `options` go to the Kafka consumer (`fetch_max_wait_ms`,
    `max_poll_records`).
    """

    def __init__(self, config: KafkaConfig, topic: str, event_type: type[E], *,
                 start: Literal["beginning", "end", "committed"] = "beginning",
                 group_id: str | None = None, dlq: EventProducer | None = None,
                 name: str | None = None, **options: Any) -> None:
        if start == "committed" and group_id is None:
            raise ValueError("start='committed' needs the group_id whose commits to read")
        self.config, self.topic, self.event_type = config, topic, event_type
        self.name = name or group_id or f"{topic}-reader"
        self._dlq = dlq
        self.undecodable = 0
        self._consumer = KafkaConsumer(
            bootstrap_servers=config.bootstrap, group_id=group_id, enable_auto_commit=False,
            auto_offset_reset="earliest", request_timeout_ms=config.request_timeout_ms,
            **options)
        try:
            self.partitions = self._assign_all()
            if start == "beginning":
                self._consumer.seek_to_beginning(*self.partitions)
            elif start == "end":
                self._consumer.seek_to_end(*self.partitions)
                for tp in self.partitions:
                    self._consumer.position(tp)  # resolve "the end" now, not at the first poll
            self._ends = self._consumer.end_offsets(self.partitions)  # for `caught_up`
        except BaseException:
            self._consumer.close()
            raise

    def _assign_all(self) -> list[TopicPartition]:
        """Assign every partition of the topic; a topic created a moment ago may take the
        metadata a request timeout to show its partitions."""
        deadline = time.monotonic() + self.config.request_timeout_ms / 1000
        while True:
            self._consumer.topics()  # full metadata: partitions_for_topic may answer partially
            parts = self._consumer.partitions_for_topic(self.topic) or set()
            if parts or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
        self._consumer.assign(tps)
        return tps

    def poll(self, timeout_ms: int = 200) -> list[Delivered[E]]:
        delivered, letters = _decode_polled(self._consumer.poll(timeout_ms=timeout_ms),
                                            {self.topic: self.event_type})
        _send_dead_letters(self._dlq, self.config, letters, self.name)
        self.undecodable += len(letters)
        return delivered

    def caught_up(self) -> bool:
        """Whether it has read to the end offsets the topic had when the reader started."""
        return all(self._consumer.position(tp) >= end for tp, end in self._ends.items())

    def seek(self, offsets: Offsets) -> None:
        """Move to `offsets` (next offset to read per partition; partitions absent stay)."""
        for tp in self.partitions:
            offset = offsets.get(offset_key(tp.topic, tp.partition))
            if offset is not None:
                self._consumer.seek(tp, offset)

    def commit_offsets(self, offsets: Offsets) -> None:
        """Record `offsets` as this reader's group's committed progress."""
        commits = {}
        for key, offset in offsets.items():
            topic, partition = key.rsplit(":", 1)
            commits[TopicPartition(topic, int(partition))] = OffsetAndMetadata(offset, "", -1)
        self._consumer.commit(commits)

    def lag(self, offsets: Offsets) -> int:
        """Records on the topic past `offsets`."""
        ends = self._consumer.end_offsets(self.partitions)
        return sum(max(0, end - offsets.get(offset_key(tp.topic, tp.partition), 0))
                   for tp, end in ends.items())

    def close(self) -> None:
        self._consumer.close()


def _from_beginning(config: KafkaConfig, topic: str, **options: Any
                   ) -> tuple[KafkaConsumer, list[TopicPartition]]:
    """A consumer outside any group, assigned every partition of `topic` at its beginning,
    and those partitions; the caller closes it. `options` go to `KafkaConsumer`."""
    consumer = KafkaConsumer(bootstrap_servers=config.bootstrap, enable_auto_commit=False,
                             group_id=None, request_timeout_ms=config.request_timeout_ms,
                             **options)
    try:
        consumer.topics()  # full metadata first: partitions_for_topic may answer partially
        tps = [TopicPartition(topic, p)
               for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
    except BaseException:
        consumer.close()
        raise
    return consumer, tps


def read_raw(config: KafkaConfig, topic: str, *, timeout_s: float = 60.0,
             quiet_ms: int = 500) -> list[tuple[bytes | None, bytes]]:
    """(key, value) of every record on `topic` from the beginning, without a group.

    Reads to the end offsets the broker reports, then on until a poll of `quiet_ms` brings
    nothing: Tansu's reported end can trail the last records of a compressed batch.
    """
    consumer, tps = _from_beginning(config, topic)
    try:
        ends = consumer.end_offsets(tps)
        out: list[tuple[bytes | None, bytes]] = []
        deadline = time.monotonic() + timeout_s
        reached_end = False
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: did not reach its end in {timeout_s:.0f}s")
            batch = consumer.poll(timeout_ms=quiet_ms if reached_end else 200)
            for records in batch.values():
                out.extend((r.key, r.value or b"") for r in records)
            if reached_end and not batch:
                return out
            reached_end = reached_end or all(consumer.position(tp) >= ends[tp] for tp in tps)
    finally:
        consumer.close()


def scan_keys(kafka: KafkaConfig, topic: str, starts: dict[int, int],
              wanted: set[str] | None = None) -> set[str]:
    """The keys of `topic` from `starts` (partition -> offset; else the beginning) to its end,
    or until every key of `wanted` is seen.

    A poll takes every fetched record (Tansu's end offset is the last batch's first offset
    + 1, so a poll that stopped partway through the last batch would look like the end)."""
    consumer, tps = _from_beginning(kafka, topic, max_poll_records=1_000_000)
    try:
        ends = consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, min(starts.get(tp.partition, 0), ends[tp]))
        keys: set[str] = set()
        deadline = time.monotonic() + 60
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: tail scan did not reach the end in 60s")
            for records in consumer.poll(timeout_ms=200).values():
                keys.update(r.key.decode() for r in records if r.key is not None)
            if wanted is not None and wanted <= keys:
                break
        return keys
    finally:
        consumer.close()


def read_all(config: KafkaConfig, topic: str, event_type: type[E], *,
             timeout_s: float = 60.0) -> list[E]:
    """Every record on `topic`, decoded as `event_type` (tests, the demo, operators)."""
    return [decode(event_type, value) for _, value in read_raw(config, topic,
                                                               timeout_s=timeout_s)]
