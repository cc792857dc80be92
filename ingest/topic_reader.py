"""Reading a whole topic: every partition, assigned by hand, with no consumer group.

`TopicReader` follows one topic from where it is told (the beginning, the end, a group's
committed offsets, stored offsets) and decodes its records (the online trainer's experiences,
a replica's releases, the bootstrap's rollout groups); `TopicFollower` does it in a thread
from the beginning for the console's tally and the trainer's monitors; `read_raw`,
`read_all` and `scan_keys` read a topic to its end once (tests, the demo, the join's tail
scan). Decoding and dead letters are ingest/log.py's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar

from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata
from pydantic import BaseModel

from ingest.config import KafkaConfig
from ingest.events import decode
from ingest.log import Delivered, EventProducer, decode_polled, send_dead_letters

E = TypeVar("E", bound=BaseModel)
log = logging.getLogger(__name__)


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
        delivered, letters = decode_polled(self._consumer.poll(timeout_ms=timeout_ms),
                                            {self.topic: self.event_type})
        send_dead_letters(self._dlq, self.config, letters, self.name)
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
    """(key, value) of every record on `topic` from the beginning, without a group; a
    tombstone (a deleted user's key, `ingest.deletions`) has the value b"".

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
                                                               timeout_s=timeout_s) if value]


class TopicFollower(Generic[E]):
    """A thread that follows `topic` from the beginning, as a reader outside any group, and
    hands each poll's events to `on_events`, until `close`. A reader that cannot start, or a
    failure while following, is logged and ends the thread: what was handed over stays."""

    def __init__(self, config: KafkaConfig, topic: str, event_type: type[E],
                 on_events: Callable[[list[E]], None], *, name: str) -> None:
        self.config, self.topic, self.event_type = config, topic, event_type
        self.on_events, self.name = on_events, name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            reader = TopicReader(self.config, self.topic, self.event_type, name=self.name)
        except Exception:  # the follower's owner sees nothing; the log says why
            log.exception("%s could not follow %s", self.name, self.topic)
            return
        try:
            while not self._stop.is_set():
                self.on_events([record.event for record in reader.poll(timeout_ms=500)])
        except Exception:  # what was handed over stays; the log says why it stopped
            log.exception("%s stopped following %s", self.name, self.topic)
        finally:
            reader.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
