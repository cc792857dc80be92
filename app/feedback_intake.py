"""Feedback intake: accepted webhook events into the `feedback` topic and the receipt ledger.

Requests hand their events to a few writer threads; each takes everything queued at once
(group commit): one SQL query finds the event ids already received, every new event is
produced, the producer is flushed and all acks awaited, then one INSERT records the receipts.
A receipt is written only after the broker acknowledged its event, so a crash in between
re-produces on retry (the join dedupes by event_id) and never loses one. Ids repeated inside a
group count as duplicates; the same id racing in two groups at once may be produced twice
(both replies say new), which the join's dedupe absorbs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy import event as sa_event
from sqlalchemy.dialects import postgresql, sqlite

from app.db import FeedbackReceipt
from ingest.events import FeedbackReceived, utcnow
from ingest.log import EventProducer

log = logging.getLogger(__name__)
_ID_CHUNK = 5000  # ids per IN (...) query: under SQLite's and PostgreSQL's parameter limits


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


class FeedbackLogUnavailable(RuntimeError):
    """The broker or the ledger refused the group; the caller may retry (503)."""


@dataclass
class _Submission:
    events: Sequence[FeedbackReceived]
    done: Future[list[bool]] = field(default_factory=Future)


class FeedbackIntake:
    """Group-commits feedback events; `accept(events)` returns one duplicate flag per event."""

    def __init__(self, *, producer: EventProducer, topic: str, db: Engine,
                 delivery_timeout_s: float, max_group_events: int = 5000,
                 writers: int = 2) -> None:
        self.producer = producer
        self.topic = topic
        self.db = db
        self.delivery_timeout_s = delivery_timeout_s
        self.max_group_events = max_group_events
        self._queue: queue.SimpleQueue[_Submission | None] = queue.SimpleQueue()
        self._closed = False
        if db.dialect.name == "sqlite":
            # WAL: readers never wait on the writer; synchronous=NORMAL: a commit survives the
            # process dying, a machine crash may lose the last receipts (re-produced on retry).
            sa_event.listen(db, "connect", _sqlite_pragmas)
            db.pool.dispose()  # pooled connections opened before the listener
        self._threads = [threading.Thread(target=self._run, name=f"feedback-intake-{i}",
                                          daemon=True) for i in range(writers)]
        for thread in self._threads:
            thread.start()

    def submit(self, events: Sequence[FeedbackReceived]) -> Future[list[bool]]:
        if self._closed:
            raise FeedbackLogUnavailable("feedback intake is closed")
        submission = _Submission(events)
        self._queue.put(submission)
        return submission.done

    async def accept(self, events: Sequence[FeedbackReceived]) -> list[bool]:
        return await asyncio.wrap_future(self.submit(events))

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued, then stop the writer thread."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)
            for thread in self._threads:
                thread.join(timeout=timeout_s)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                return
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

    def _commit(self, group: list[_Submission]) -> None:
        try:
            flags = self._write(group)
        except Exception as exc:  # noqa: BLE001 - every waiting request must hear of it
            log.warning("feedback group of %d failed: %s", len(group), exc)
            for sub in group:
                sub.done.set_exception(FeedbackLogUnavailable(str(exc)))
            return
        for sub, sub_flags in zip(group, flags, strict=True):
            sub.done.set_result(sub_flags)

    def _write(self, group: list[_Submission]) -> list[list[bool]]:
        received = self._existing({e.event_id for sub in group for e in sub.events})
        fresh: dict[str, FeedbackReceived] = {}
        flags = []
        for sub in group:
            sub_flags = []
            for event in sub.events:
                duplicate = event.event_id in received or event.event_id in fresh
                if not duplicate:
                    fresh[event.event_id] = event
                sub_flags.append(duplicate)
            flags.append(sub_flags)
        if fresh:
            futures = [self.producer.send(self.topic, e.generation_id, e)
                       for e in fresh.values()]
            self.producer.flush(self.delivery_timeout_s)  # no linger: the group is the batch
            for future in futures:
                future.get(timeout=self.delivery_timeout_s)
            self._record(list(fresh.values()))
        return flags

    def _existing(self, event_ids: set[str]) -> set[str]:
        ids = sorted(event_ids)
        column = FeedbackReceipt.__table__.c.event_id  # type: ignore[attr-defined]
        found: set[str] = set()
        with self.db.connect() as conn:
            for start in range(0, len(ids), _ID_CHUNK):
                chunk = ids[start:start + _ID_CHUNK]
                found.update(conn.execute(select(column).where(column.in_(chunk))).scalars())
        return found

    def _record(self, events: list[FeedbackReceived]) -> None:
        table = FeedbackReceipt.__table__  # type: ignore[attr-defined]
        dialect = sqlite if self.db.dialect.name == "sqlite" else postgresql
        stmt = dialect.insert(table).on_conflict_do_nothing(index_elements=["event_id"])
        now = utcnow()
        rows = [{"event_id": e.event_id, "generation_id": e.generation_id, "kind": e.kind,
                 "received_at": now} for e in events]
        with self.db.begin() as conn:
            conn.execute(stmt, rows)
