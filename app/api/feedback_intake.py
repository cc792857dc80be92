"""Feedback intake: accepted webhook events into the `feedback` topic and the receipts table.

Requests queue their events for one writer thread, which takes everything queued at once
(group commit): ids received lately are answered from memory, the rest with one SQL query;
every new event is produced, keyed by its generation_id (or a session verdict's session_id),
and the acks awaited, then one INSERT … ON CONFLICT DO NOTHING records
the receipts and one callback per event loop wakes the waiting requests. A receipt is written
only after the broker acknowledged its event, so a crash in between re-produces on retry (the
join dedupes by event_id) and never loses one. One writer means one group in flight: an id
repeated while its first copy is being produced is settled by that group, never produced
twice by this process.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine

from app.db import FeedbackReceipt
from ingest.events import FeedbackReceived, encode, utcnow
from ingest.log import EventProducer
from ingest.sql import existing_ids, insert_rows

log = logging.getLogger(__name__)


class FeedbackLogUnavailable(RuntimeError):
    """The broker or the receipts table refused the group; the caller may retry (503)."""


@dataclass
class _Submission:
    events: Sequence[FeedbackReceived]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[list[bool]]


class RecentIds:
    """The last `capacity` event ids with a stored receipt, oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: dict[str, None] = {}

    def __contains__(self, event_id: object) -> bool:
        return event_id in self._ids

    def add(self, event_ids: Sequence[str]) -> None:
        ids = self._ids
        ids.update(dict.fromkeys(event_ids))
        for _ in range(len(ids) - self.capacity):
            del ids[next(iter(ids))]


def _settle(results: list[tuple[asyncio.Future[list[bool]], Any]]) -> None:
    """Runs on the event loop: hand each waiting request its flags or its error."""
    for future, outcome in results:
        if future.done():  # the request was cancelled meanwhile
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


class FeedbackIntake:
    """Group-commits feedback events; `accept(events)` returns one duplicate flag per event."""

    def __init__(self, *, producer: EventProducer, topic: str, db: Engine,
                 delivery_timeout_s: float, max_group_events: int = 5000,
                 recent_ids: int = 200_000) -> None:
        self.producer = producer
        self.topic = topic
        self.db = db
        self.delivery_timeout_s = delivery_timeout_s
        self.max_group_events = max_group_events
        self.recent = RecentIds(recent_ids)
        self.receipts = Receipts(db)
        self._queue: queue.SimpleQueue[_Submission | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="feedback-intake", daemon=True)
        self._thread.start()

    async def accept(self, events: Sequence[FeedbackReceived]) -> list[bool]:
        if self._closed:
            raise FeedbackLogUnavailable("feedback intake is closed")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[bool]] = loop.create_future()
        self._queue.put(_Submission(events, loop, done))
        return await done

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued, then stop the writer thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            group, size = [first], len(first.events)
            while size < self.max_group_events:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                group.append(item)
                size += len(item.events)
            self._commit(group)
        self.receipts.close()

    def _commit(self, group: list[_Submission]) -> None:
        outcomes: list[Any]
        try:
            outcomes = self._write(group)
        except Exception as exc:  # noqa: BLE001 - every waiting request must hear of it
            log.warning("feedback group of %d failed: %s", len(group), exc)
            outcomes = [FeedbackLogUnavailable(str(exc))] * len(group)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
        for sub, outcome in zip(group, outcomes, strict=True):
            by_loop.setdefault(sub.loop, []).append((sub.done, outcome))
        for loop, results in by_loop.items():  # one wake-up per loop, not per request
            try:
                loop.call_soon_threadsafe(_settle, results)
            except RuntimeError:  # that loop has closed: nobody waits any more
                pass

    def _write(self, group: list[_Submission]) -> list[list[bool]]:
        recent = self.recent
        unknown = {e.event_id for sub in group for e in sub.events if e.event_id not in recent}
        received = self._existing(unknown) if unknown else set()
        fresh: dict[str, FeedbackReceived] = {}
        flags = []
        for sub in group:
            sub_flags = []
            for event in sub.events:
                event_id = event.event_id
                duplicate = event_id in recent or event_id in received or event_id in fresh
                if not duplicate:
                    fresh[event_id] = event
                sub_flags.append(duplicate)
            flags.append(sub_flags)
        if received:
            recent.add(list(received))
        if fresh:
            self._produce(list(fresh.values()))
            self._record(list(fresh.values()))
            recent.add(list(fresh))
        return flags

    def _produce(self, events: list[FeedbackReceived]) -> None:
        """Send every event keyed by its key (generation_id, or a verdict's session_id) and
        wait for the acks; raises the broker's error for any refused."""
        self.producer.deliver(self.topic, [(e.key, encode(e)) for e in events],
                              timeout_s=self.delivery_timeout_s)

    def _existing(self, event_ids: set[str]) -> set[str]:
        return self.receipts.existing(event_ids)

    def _record(self, events: list[FeedbackReceived]) -> None:
        self.receipts.record(events)


class Receipts:
    """The `feedbackreceipt` table, through one connection the writer thread keeps.

    Receipts go in as one executemany of plain tuples (the timestamp converted once per
    group, not once per row); a connection that failed is dropped and reopened next time.
    """

    def __init__(self, db: Engine) -> None:
        self.db = db
        table = FeedbackReceipt.__table__  # type: ignore[attr-defined]
        self._column = table.c.event_id
        self._to_db = table.c.received_at.type.bind_processor(db.dialect) or (lambda v: v)
        self._table = table.name
        self._conn: Connection | None = None

    def existing(self, event_ids: set[str]) -> set[str]:
        with self._transaction() as conn:
            return existing_ids(conn, self._column, event_ids)

    def record(self, events: list[FeedbackReceived]) -> None:
        now = self._to_db(utcnow())
        # the receipt's generation_id column holds the event's key: a session verdict's is
        # its session_id (nothing reads the column; see app.db.FeedbackReceipt)
        rows = [(e.event_id, e.key, e.kind, now) for e in events]
        with self._transaction() as conn:
            insert_rows(conn, self._table, ("event_id", "generation_id", "kind", "received_at"),
                        rows, skip_existing=True)

    @contextmanager
    def _transaction(self) -> Iterator[Connection]:
        if self._conn is None:
            self._conn = self.db.connect()
        try:
            with self._conn.begin():
                yield self._conn
        except Exception:
            self._conn.invalidate()
            self._conn = None
            raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
