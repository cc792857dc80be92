"""The join's memory in SQL (SQLite under the data dir by default, PostgreSQL by URL).

Five tables, owned by `ingest.join` (session verdicts add three: `ingest.join_sessions_state`):
- `join_session`: sessions seen (the GenerationLogged JSON), until they expire.
- `join_feedback`: every feedback event id ever seen (the dedupe ledger) and its state:
  pending (no session yet; the FeedbackReceived JSON kept for the match), matched, or
  expired. Only pending rows are indexed beyond the key (partial indexes): the ledger grows
  with every event, the lookups are all of pending ones.
- `join_outbox_batch`: the experiences matched and not yet produced, one row per input
  partition (`source`) of their generations per poll, numbered by a sequence within the
  source: the member that owns the partition numbers its batches (one writer per source, so
  no shared counter) and produces them in order. A batch holds the feedback events and their
  rewards, not the experiences: those are rebuilt from the stored sessions when needed (after
  a crash), so a session judged many times is stored once, whatever its length. One row per
  batch, not per experience: a poll's matches cost one insert, not thousands. (A session
  verdict's experiences go in batches of the verdict's own input partition, and
  `join_outbox_turn` names the generation and turn of each.)
- `join_produced`: per source, the `seq` up to which its batches are produced (one write per
  produce round); the sweep deletes the batches below it, and keeps the sessions of the
  batches above it from expiring.
- `join_progress`: per source and experiences partition, the highest offset the join saw
  acked, so a new owner scans only the tail of the topic for records its predecessor
  produced but did not mark.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from pydantic import BaseModel
from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Index,
    Text,
    delete,
    event,
    func,
    select,
    text,
    update,
)
from sqlmodel import Column, Field, SQLModel, col, create_engine

from ingest.events import EventDecodeError, FeedbackReceived, GenerationLogged
from ingest.experience_json import Turn
from ingest.join_sessions_state import SESSION_TABLES, JoinOutboxTurn, TurnRow, paid_generations
from ingest.log import decode_all, list_adapter
from ingest.sql_ids import IDS, insert_rows
from ingest.sql_ids import chunks as _chunks
from ingest.sql_tables import create_tables

PENDING, MATCHED, EXPIRED = "pending", "matched", "expired"
E = TypeVar("E", bound=BaseModel)
_IS_PENDING = text("state = 'pending'")


class JoinSession(SQLModel, table=True):
    __tablename__ = "join_session"

    generation_id: str = Field(primary_key=True, max_length=128)
    payload: str = Field(sa_column=Column(Text, nullable=False))
    first_seen: float = Field(index=True)
    matched: bool = False  # an experience came of it: expiry is then no loss


class JoinFeedback(SQLModel, table=True):
    __tablename__ = "join_feedback"
    __table_args__ = (
        Index("ix_join_feedback_pending_generation", "generation_id",
              sqlite_where=_IS_PENDING, postgresql_where=_IS_PENDING),
        Index("ix_join_feedback_pending_since", "first_seen",
              sqlite_where=_IS_PENDING, postgresql_where=_IS_PENDING),
    )

    event_id: str = Field(primary_key=True, max_length=128)
    generation_id: str = Field(max_length=128)
    payload: str = Field(sa_column=Column(Text, nullable=False))
    first_seen: float
    state: str = Field(default=PENDING, max_length=16)


class JoinOutbox(SQLModel, table=True):
    """Matches of one poll in one input partition whose experiences are not all produced yet:
    `feedback`, their FeedbackReceived events as received (a JSON array), `rewards` theirs
    (a JSON array, in the same order); each one's session is its generation's join_session
    row. A stale member that kept writing after its partition moved collides on the key and
    fails."""

    __tablename__ = "join_outbox_batch"

    source: int = Field(primary_key=True)  # the generations' input partition: its owner's
    seq: int = Field(sa_column=Column(BigInteger, primary_key=True, autoincrement=False))
    feedback: str = Field(sa_column=Column(Text, nullable=False))
    rewards: str = Field(sa_column=Column(Text, nullable=False))
    joined_at: float  # unix seconds


class JoinProduced(SQLModel, table=True):
    """Outbox batches of input partition `source` up to `seq` are produced."""

    __tablename__ = "join_produced"

    source: int = Field(primary_key=True)
    seq: int


class JoinProgress(SQLModel, table=True):
    """The highest acked offset on experiences partition `partition` of the outbox batches
    of input partition `source` (one owner at a time produces those, in order)."""

    __tablename__ = "join_progress"

    source: int = Field(primary_key=True)
    partition: int = Field(primary_key=True)
    offset: int


TABLES = [JoinSession.__table__, JoinFeedback.__table__,  # type: ignore[attr-defined]
          JoinOutbox.__table__, JoinProduced.__table__,  # type: ignore[attr-defined]
          JoinProgress.__table__, *SESSION_TABLES]  # type: ignore[attr-defined]


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.isolation_level = None  # the driver's own BEGIN off: `_begin_immediate` does it
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA wal_autocheckpoint=0")  # `writing` checkpoints, outside the lock
    cursor.execute("PRAGMA journal_size_limit=67108864")  # the log's file cut to 64 MB after
    # 64 MiB of page cache, not 2: the ledger's index of random event ids grows for good, and
    # past the cache each insert reads pages back from the OS. `bench/join_wal.py --batches
    # 1000` (a million rows): 32.1 -> 24.7 µs per row (docs/feedback.md)
    cursor.execute("PRAGMA cache_size=-65536")
    cursor.close()


def _begin_immediate(conn: Any) -> None:
    """Take SQLite's write lock when a transaction begins: several join processes on one file
    then queue for it (busy_timeout) instead of failing when a read turns into a write."""
    conn.exec_driver_sql("BEGIN IMMEDIATE")


class _WriterLock:
    """Queues this process's SQLite write transactions behind other processes' in the kernel
    (flock on `<db>.writer`). BEGIN IMMEDIATE alone would also serialize them, but a waiter
    there polls: SQLite's busy handler sleeps in steps growing to 100 ms, so two members spend
    much of their time asleep while the lock is free. (One lock per process: its threads
    share it, and SQLite's own lock still orders them.)

    Also times the WAL's checkpoints. SQLite's automatic one runs inside the COMMIT that
    takes the log past 1,000 pages, copying them into the database file and syncing it, while
    this process holds the lock. The join's connections turn it off; `writing` runs a PASSIVE
    checkpoint (it waits for no reader or writer) after releasing the lock, at most every
    CHECKPOINT_EVERY_S, which keeps the log to a fraction of a second of writes (and its file
    is cut back to 64 MB). In `bench/join_wal.py` (the join's writes, 1,000 rows per
    transaction) the lock was held 24.3 µs per row with SQLite's checkpoints and 13.6 with
    these, 29.3 against 21.7 in all (docs/feedback.md)."""

    CHECKPOINT_EVERY_S = 0.25

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._last_checkpoint = -math.inf

    @contextmanager
    def held(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def checkpoint_due(self) -> bool:
        now = time.monotonic()
        if now - self._last_checkpoint < self.CHECKPOINT_EVERY_S:
            return False
        self._last_checkpoint = now
        return True


_WRITERS: dict[str, _WriterLock] = {}


@contextmanager
def writing(engine: Engine) -> Iterator[Connection]:
    """`engine.begin()` for a transaction that writes; on a SQLite file, after waiting for
    the other processes' (`_WriterLock`), and followed by a checkpoint when one is due."""
    database = engine.url.database if engine.dialect.name == "sqlite" else None
    if not database or database == ":memory:":
        with engine.begin() as conn:
            yield conn
        return
    lock = _WRITERS.get(database)
    if lock is None:
        lock = _WRITERS[database] = _WriterLock(Path(f"{database}.writer"))
    with lock.held(), engine.begin() as conn:
        yield conn
    if lock.checkpoint_due():
        checkpoint(engine)


def checkpoint(engine: Engine) -> tuple[int, int, int]:
    """PRAGMA wal_checkpoint(PASSIVE) outside any transaction: (busy, frames in the log,
    frames checkpointed)."""
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("PRAGMA wal_checkpoint(PASSIVE)")
        busy, log, done = cursor.fetchone() or (0, 0, 0)
        cursor.close()
    finally:
        raw.close()
    return int(busy), int(log), int(done)


def open_state(url: str) -> Engine:
    """Create the engine and the join's tables (idempotent)."""
    sqlite_url = url.startswith("sqlite")
    engine = create_engine(url, connect_args={"check_same_thread": False} if sqlite_url else {})
    if sqlite_url:
        # WAL + synchronous=NORMAL: a commit survives the process being killed (the OS holds
        # the WAL); only a machine crash can lose the last ones, which Kafka re-delivers.
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _begin_immediate)
    create_tables(engine, TABLES)
    return engine


class SessionRow(NamedTuple):
    """A join_session row, in column order."""

    generation_id: str
    payload: str
    first_seen: float
    matched: bool


class FeedbackRow(NamedTuple):
    """A join_feedback row, in column order."""

    event_id: str
    generation_id: str
    payload: str
    first_seen: float
    state: str


def insert_new(conn: Connection, table: type[JoinSession] | type[JoinFeedback],
               rows: Sequence[SessionRow] | Sequence[FeedbackRow]) -> None:
    """INSERT session or feedback rows, skipping keys that exist (the dedupe of at-least-once
    delivery)."""
    fields = SessionRow._fields if table is JoinSession else FeedbackRow._fields
    insert_rows(conn, str(table.__tablename__), fields, rows, skip_existing=True)


def _decoded(event_type: type[E], payloads: Sequence[str]) -> list[E]:
    """Payloads this join stored after decoding them once: an error here is a bug, raised."""
    events = decode_all(event_type, [p.encode() for p in payloads])
    for event_ in events:
        if isinstance(event_, EventDecodeError):
            raise event_
    return events  # type: ignore[return-value]


def stored_sessions(conn: object, generation_ids: Collection[str]
                    ) -> dict[str, tuple[GenerationLogged, bool]]:
    """The stored sessions among `generation_ids`, decoded, each with its matched flag."""
    ids: list[str] = []
    payloads: list[str] = []
    matched: list[bool] = []
    for chunk in _chunks(generation_ids):
        for generation_id, payload, flag in conn.execute(  # type: ignore[attr-defined]
                select(col(JoinSession.generation_id), col(JoinSession.payload),
                       col(JoinSession.matched))
                .where(col(JoinSession.generation_id).in_(IDS)),  # type: ignore[attr-defined]
                {"ids": chunk}):
            ids.append(generation_id)
            payloads.append(payload)
            matched.append(bool(flag))
    return dict(zip(ids, zip(_decoded(GenerationLogged, payloads), matched, strict=True),
                    strict=True))


def _claim(conn: object, column: Any, ids: Collection[str], returned: Any) -> list[str]:
    """Mark the pending feedback whose `column` is among `ids` matched; returns `returned` of
    the rows this call moved (a concurrent member that moved one first keeps it)."""
    out: list[str] = []
    for chunk in _chunks(ids):
        out += conn.execute(  # type: ignore[attr-defined]
            update(JoinFeedback).where(_IS_PENDING, column.in_(IDS))
            .values(state=MATCHED).returning(returned), {"ids": chunk}).scalars()
    return out


def claim_waiting(conn: object, generation_ids: Collection[str]
                  ) -> list[tuple[FeedbackReceived, str]]:
    """Mark the stored feedback still waiting for one of `generation_ids` matched, and return
    it: decoded, and as stored."""
    payloads = _claim(conn, JoinFeedback.generation_id, generation_ids, JoinFeedback.payload)
    return list(zip(_decoded(FeedbackReceived, payloads), payloads, strict=True))


def pending_with_sessions(conn: object, keep: Callable[[str], bool]
                          ) -> list[tuple[FeedbackReceived, GenerationLogged]]:
    """Pending feedback whose session is stored after all, for the generation ids `keep`
    accepts (decoded only for those): what two join members can leave behind when a partition
    moves between them mid-poll (each stored its half before seeing the other's). The sweep
    matches them."""
    rows = [(f, s) for g, f, s in conn.execute(  # type: ignore[attr-defined]
        select(col(JoinFeedback.generation_id), col(JoinFeedback.payload),
               col(JoinSession.payload)).join(
            JoinSession, col(JoinSession.generation_id) == col(JoinFeedback.generation_id))
        .where(_IS_PENDING)) if keep(g)]
    feedback = _decoded(FeedbackReceived, [f for f, _ in rows])
    sessions = _decoded(GenerationLogged, [s for _, s in rows])
    return list(zip(feedback, sessions, strict=True))


def stale_pending(conn: object, cutoff: float) -> list[tuple[str, str, str]]:
    """(event id, generation id, payload) of feedback pending since before `cutoff`."""
    return conn.execute(  # type: ignore[attr-defined]
        select(col(JoinFeedback.event_id), col(JoinFeedback.generation_id),
               col(JoinFeedback.payload))
        .where(_IS_PENDING, col(JoinFeedback.first_seen) < cutoff)).tuples().all()


def stale_sessions(conn: object, cutoff: float) -> list[tuple[str, str, bool]]:
    """(generation id, payload, matched) of the sessions first seen before `cutoff`."""
    return conn.execute(  # type: ignore[attr-defined]
        select(col(JoinSession.generation_id), col(JoinSession.payload),
               col(JoinSession.matched))
        .where(col(JoinSession.first_seen) < cutoff)).tuples().all()


def expire_feedback(conn: object, event_ids: Collection[str]) -> None:
    """Pending feedback `event_ids` timed out (the dead letters are sent)."""
    for chunk in _chunks(event_ids):
        conn.execute(update(JoinFeedback).where(  # type: ignore[attr-defined]
            JoinFeedback.event_id.in_(IDS)).values(state=EXPIRED), {"ids": chunk})  # type: ignore[attr-defined]


def forget_sessions(conn: object, generation_ids: Collection[str]) -> None:
    """Delete the stored sessions `generation_ids` (expired)."""
    for chunk in _chunks(generation_ids):
        conn.execute(delete(JoinSession).where(  # type: ignore[attr-defined]
            JoinSession.generation_id.in_(IDS)), {"ids": chunk})  # type: ignore[attr-defined]


def sessions_matched(conn: object, generation_ids: Collection[str]) -> None:
    """Stored sessions `generation_ids` yielded an experience (their expiry is no loss)."""
    for chunk in _chunks(generation_ids):
        conn.execute(update(JoinSession).where(  # type: ignore[attr-defined]
            JoinSession.generation_id.in_(IDS)).values(matched=True), {"ids": chunk})  # type: ignore[attr-defined]


def claim_pending(conn: object, event_ids: Collection[str]) -> set[str]:
    """Mark pending feedback `event_ids` matched; returns those this call moved (a concurrent
    member that claimed one first makes it drop out, so each experience is queued once)."""
    return set(_claim(conn, JoinFeedback.event_id, event_ids, JoinFeedback.event_id))


class OutboxRow(NamedTuple):
    """A join_outbox_batch row, in column order."""

    source: int
    seq: int
    feedback: str  # a JSON array of FeedbackReceived
    rewards: str  # a JSON array of floats
    joined_at: float


def outbox_row(source: int, seq: int, feedback: Sequence[bytes], rewards: Sequence[float],
               joined_at: float) -> OutboxRow:
    """The batch of `feedback` (each a FeedbackReceived's JSON) with its `rewards`."""
    return OutboxRow(source, seq, (b"[" + b",".join(feedback) + b"]").decode(),
                     json.dumps(list(rewards)), joined_at)


def add_to_outbox(conn: Connection, rows: Sequence[OutboxRow],
                  turns: Sequence[TurnRow] = ()) -> None:
    """INSERT the batches (and the turns of those that hold session verdicts'); a key that
    exists fails (a stale member still writing)."""
    insert_rows(conn, str(JoinOutbox.__tablename__), OutboxRow._fields, rows)
    insert_rows(conn, str(JoinOutboxTurn.__tablename__), TurnRow._fields, turns)


def last_seqs(conn: object, sources: Collection[int]) -> dict[int, int]:
    """The highest seq each of `sources` used (0 for none): stored batches or produced marks."""
    last = {source: conn.execute(select(func.max(JoinOutbox.seq)).where(  # type: ignore[attr-defined]
        col(JoinOutbox.source) == source)).scalar() or 0 for source in sources}
    for source, seq in produced_marks(conn, sources).items():
        last[source] = max(last[source], seq)
    return last


class Unproduced(NamedTuple):
    """One experience of an unproduced outbox batch, with what rebuilds it."""

    source: int
    seq: int
    feedback: FeedbackReceived
    reward: float
    session: GenerationLogged
    joined_at: float
    turn: Turn | None = None  # a session verdict's experience: which turn `session` is


def _unproduced_batches() -> Any:
    """SELECT the join_outbox_batch rows above their source's produced mark (every column),
    with their join_outbox_turn's `turns` (NULL for most)."""
    return select(col(JoinOutbox.source), col(JoinOutbox.seq), col(JoinOutbox.feedback),
                  col(JoinOutbox.rewards), col(JoinOutbox.joined_at),
                  col(JoinOutboxTurn.turns)).join(
        JoinProduced, JoinProduced.source == JoinOutbox.source, isouter=True).join(  # type: ignore[arg-type]
        JoinOutboxTurn, (JoinOutboxTurn.source == JoinOutbox.source)  # type: ignore[arg-type]
        & (JoinOutboxTurn.seq == JoinOutbox.seq), isouter=True).where(  # type: ignore[arg-type]
        JoinProduced.seq.is_(None) | (JoinOutbox.seq > JoinProduced.seq))  # type: ignore[attr-defined]


def unproduced(conn: object, sources: Collection[int]) -> list[Unproduced]:
    """The experiences of the outbox batches of `sources` not produced yet, by source, seq and
    place in the batch, each with its feedback and its session decoded."""
    decode = list_adapter(FeedbackReceived).validate_json
    found = []
    for source, seq, feedback, rewards, joined_at, turns in conn.execute(  # type: ignore[attr-defined]
            _unproduced_batches().where(JoinOutbox.source.in_(sorted(sources)))  # type: ignore[attr-defined]
            .order_by(JoinOutbox.source, JoinOutbox.seq)):
        events, values = decode(feedback), json.loads(rewards)
        paid = paid_generations([f.generation_id for f in events], turns)
        for f, reward, (generation_id, turn) in zip(events, values, paid, strict=True):
            found.append((source, seq, f, reward, joined_at, generation_id, turn))
    sessions = stored_sessions(conn, {generation_id for *_, generation_id, _ in found})
    out = []
    for source, seq, f, reward, joined_at, generation_id, turn in found:
        if generation_id not in sessions:  # expire() keeps these: a bug if it did not
            raise RuntimeError(f"outbox batch {source}/{seq}: session {generation_id} "
                               "is gone")
        out.append(Unproduced(source, seq, f, reward, sessions[generation_id][0], joined_at, turn))
    return out


def awaited_sessions(conn: object) -> set[str]:
    """The generation ids whose sessions an unproduced outbox batch still needs."""
    awaited: set[str] = set()
    for _, _, feedback, _, _, turns in conn.execute(_unproduced_batches()):  # type: ignore[attr-defined]
        paid = paid_generations([f["generation_id"] for f in json.loads(feedback)], turns)
        awaited.update(generation_id for generation_id, _ in paid)
    return awaited


def produced_marks(conn: object, sources: Collection[int]) -> dict[int, int]:
    return dict(conn.execute(select(col(JoinProduced.source), col(JoinProduced.seq)).where(  # type: ignore[attr-defined]
        JoinProduced.source.in_(sorted(sources)))).tuples().all())  # type: ignore[attr-defined]


def acked_offsets(conn: object, sources: Collection[int]) -> list[tuple[int, int, int]]:
    """(source, experiences partition, offset): the highest offsets acked for `sources`."""
    return conn.execute(  # type: ignore[attr-defined]
        select(col(JoinProgress.source), col(JoinProgress.partition), col(JoinProgress.offset))
        .where(col(JoinProgress.source).in_(sorted(sources)))).tuples().all()


def _raise_to(conn: object, table: Any, key: dict[str, int], column: str, value: int) -> None:
    """Set `table.column` of the row at `key` to `value` if that is higher (insert if absent)."""
    where = [getattr(table, k) == v for k, v in key.items()]
    row = conn.execute(select(getattr(table, column)).where(*where)).scalar()  # type: ignore[attr-defined]
    if row is None:
        conn.execute(table.__table__.insert(), {**key, column: value})  # type: ignore[attr-defined]
    elif value > row:
        conn.execute(update(table).where(*where).values({column: value}))  # type: ignore[attr-defined]


def mark_produced(conn: object, marks: dict[int, int],
                  offsets: dict[tuple[int, int], int]) -> None:
    """Outbox batches up to seq `marks[source]` are produced; remember the highest acked
    offset per (source, experiences partition)."""
    for source, seq in marks.items():
        _raise_to(conn, JoinProduced, {"source": source}, "seq", seq)
    for (source, partition), offset in offsets.items():
        _raise_to(conn, JoinProgress, {"source": source, "partition": partition}, "offset",
                  offset)


def prune_outbox(conn: object, sources: Collection[int]) -> int:
    """Delete the produced outbox batches of `sources`; returns how many."""
    deleted = 0
    for source, seq in produced_marks(conn, sources).items():
        deleted += conn.execute(delete(JoinOutbox).where(  # type: ignore[attr-defined]
            JoinOutbox.seq <= seq, JoinOutbox.source == source)).rowcount  # type: ignore[operator,arg-type]
        conn.execute(delete(JoinOutboxTurn).where(  # type: ignore[attr-defined]
            JoinOutboxTurn.seq <= seq, JoinOutboxTurn.source == source))  # type: ignore[operator,arg-type]
    return deleted
