"""The join's memory in SQL (SQLite under the data dir by default, PostgreSQL by URL).

Four tables, owned by `ingest.join`:
- `join_session`: sessions seen (the GenerationLogged JSON), until they expire.
- `join_feedback`: every feedback event id ever seen (the dedupe ledger) and its state:
  pending (no session yet; the FeedbackReceived JSON kept for the match), matched, or
  expired.
- `join_experience`: the outbox: experiences built at match time, `produced` once acked, with
  the input partition of their generation (the member that owns it drains them).
- `join_progress`: per input partition and experiences partition, the highest offset the
  join saw acked, so a new owner scans only the tail of the topic for records its
  predecessor produced but did not mark.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy import Engine, Text, event, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Column, Field, SQLModel, create_engine

from ingest.events import EventDecodeError, FeedbackReceived, GenerationLogged
from ingest.log import decode_all
from ingest.sql_ids import IDS
from ingest.sql_ids import chunks as _chunks

PENDING, MATCHED, EXPIRED = "pending", "matched", "expired"
E = TypeVar("E", bound=BaseModel)


class JoinSession(SQLModel, table=True):
    __tablename__ = "join_session"

    generation_id: str = Field(primary_key=True, max_length=128)
    payload: str = Field(sa_column=Column(Text, nullable=False))
    first_seen: float = Field(index=True)
    matched: bool = False  # an experience came of it: expiry is then no loss


class JoinFeedback(SQLModel, table=True):
    __tablename__ = "join_feedback"

    event_id: str = Field(primary_key=True, max_length=128)
    generation_id: str = Field(index=True, max_length=128)
    payload: str = Field(sa_column=Column(Text, nullable=False))
    first_seen: float = Field(index=True)
    state: str = Field(default=PENDING, index=True, max_length=16)


class JoinExperience(SQLModel, table=True):
    __tablename__ = "join_experience"

    experience_id: str = Field(primary_key=True, max_length=128)
    event_id: str = Field(max_length=128)
    generation_id: str = Field(max_length=128)
    partition: int = Field(default=0)  # the generation's sessions/feedback partition: its owner
    payload: str = Field(sa_column=Column(Text, nullable=False))
    produced: bool = Field(default=False, index=True)


class JoinProgress(SQLModel, table=True):
    """The highest acked offset on experiences partition `partition` of the outbox rows of
    input partition `source` (one owner at a time produces those, in order)."""

    __tablename__ = "join_progress"

    source: int = Field(primary_key=True)
    partition: int = Field(primary_key=True)
    offset: int


TABLES = [JoinSession.__table__, JoinFeedback.__table__,  # type: ignore[attr-defined]
          JoinExperience.__table__, JoinProgress.__table__]  # type: ignore[attr-defined]


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.isolation_level = None  # the driver's own BEGIN off: `_begin_immediate` does it
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _begin_immediate(conn: Any) -> None:
    """Take SQLite's write lock when a transaction begins: several join processes on one file
    then queue for it (busy_timeout) instead of failing when a read turns into a write."""
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def open_state(url: str) -> Engine:
    """Create the engine and the join's tables (idempotent)."""
    sqlite_url = url.startswith("sqlite")
    engine = create_engine(url, connect_args={"check_same_thread": False} if sqlite_url else {})
    if sqlite_url:
        # WAL + synchronous=NORMAL: a commit survives the process being killed (the OS holds
        # the WAL); only a machine crash can lose the last ones, which Kafka re-delivers.
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _begin_immediate)
    SQLModel.metadata.create_all(engine, tables=TABLES)
    return engine


def insert_new(engine: Engine, table: type[SQLModel], rows: Sequence[dict[str, object]],
               conn: object) -> None:
    """INSERT rows, skipping keys that exist (the dedupe of at-least-once delivery)."""
    if not rows:
        return
    dialect = sqlite if engine.dialect.name == "sqlite" else postgresql
    stmt = dialect.insert(table.__table__).on_conflict_do_nothing()  # type: ignore[attr-defined]
    conn.execute(stmt, list(rows))  # type: ignore[attr-defined]


def _decoded(event_type: type[E], payloads: Sequence[str]) -> list[E]:
    """Payloads this join stored after decoding them once: an error here is a bug, raised."""
    events = decode_all(event_type, [p.encode() for p in payloads])
    for event_ in events:
        if isinstance(event_, EventDecodeError):
            raise event_
    return events  # type: ignore[return-value]


def stored_sessions(conn: object, generation_ids: Collection[str]
                    ) -> dict[str, GenerationLogged]:
    """The stored sessions among `generation_ids`, decoded."""
    ids: list[str] = []
    payloads: list[str] = []
    for chunk in _chunks(generation_ids):
        for generation_id, payload in conn.execute(  # type: ignore[attr-defined]
                select(JoinSession.generation_id, JoinSession.payload)
                .where(JoinSession.generation_id.in_(IDS)),  # type: ignore[attr-defined]
                {"ids": chunk}):
            ids.append(generation_id)
            payloads.append(payload)
    return dict(zip(ids, _decoded(GenerationLogged, payloads), strict=True))


def pending_feedback(conn: object, generation_ids: Collection[str]) -> list[FeedbackReceived]:
    """Stored feedback still waiting for one of `generation_ids`, decoded."""
    payloads: list[str] = []
    for chunk in _chunks(generation_ids):
        payloads += conn.execute(select(JoinFeedback.payload).where(  # type: ignore[attr-defined]
            JoinFeedback.state == PENDING,
            JoinFeedback.generation_id.in_(IDS)), {"ids": chunk}).scalars()  # type: ignore[attr-defined]
    return _decoded(FeedbackReceived, payloads)


def pending_with_sessions(conn: object, keep: Callable[[str], bool]
                          ) -> list[tuple[FeedbackReceived, GenerationLogged]]:
    """Pending feedback whose session is stored after all, for the generation ids `keep`
    accepts (decoded only for those): what two join members can leave behind when a partition
    moves between them mid-poll (each stored its half before seeing the other's). The sweep
    matches them."""
    rows = [(f, s) for g, f, s in conn.execute(  # type: ignore[attr-defined]
        select(JoinFeedback.generation_id, JoinFeedback.payload, JoinSession.payload).join(
            JoinSession, JoinSession.generation_id == JoinFeedback.generation_id)  # type: ignore[arg-type]
        .where(JoinFeedback.state == PENDING)) if keep(g)]
    feedback = _decoded(FeedbackReceived, [f for f, _ in rows])
    sessions = _decoded(GenerationLogged, [s for _, s in rows])
    return list(zip(feedback, sessions, strict=True))


def set_matched(conn: object, event_ids: Collection[str],
                generation_ids: Collection[str]) -> None:
    """Stored feedback `event_ids` and stored sessions `generation_ids` found their match."""
    for chunk in _chunks(event_ids):
        conn.execute(update(JoinFeedback).where(  # type: ignore[attr-defined]
            JoinFeedback.event_id.in_(IDS)).values(state=MATCHED), {"ids": chunk})  # type: ignore[attr-defined]
    for chunk in _chunks(generation_ids):
        conn.execute(update(JoinSession).where(  # type: ignore[attr-defined]
            JoinSession.generation_id.in_(IDS)).values(matched=True), {"ids": chunk})  # type: ignore[attr-defined]


def claim_pending(conn: object, event_ids: Collection[str]) -> set[str]:
    """Mark pending feedback `event_ids` matched; returns those this call moved (a concurrent
    member that claimed one first makes it drop out, so each experience is queued once)."""
    claimed: set[str] = set()
    for chunk in _chunks(event_ids):
        claimed.update(conn.execute(  # type: ignore[attr-defined]
            update(JoinFeedback).where(JoinFeedback.event_id.in_(IDS),  # type: ignore[attr-defined]
                                       JoinFeedback.state == PENDING)
            .values(state=MATCHED).returning(JoinFeedback.event_id), {"ids": chunk}).scalars())
    return claimed


def mark_produced(conn: object, experience_ids: Sequence[str],
                  offsets: dict[tuple[int, int], int]) -> None:
    """Mark outbox rows produced and remember the highest acked offset per (input partition,
    experiences partition)."""
    for chunk in _chunks(experience_ids):
        conn.execute(update(JoinExperience).where(  # type: ignore[attr-defined]
            JoinExperience.experience_id.in_(IDS)).values(produced=True),  # type: ignore[attr-defined]
            {"ids": chunk})
    for (source, partition), offset in offsets.items():
        where = (JoinProgress.source == source, JoinProgress.partition == partition)
        row = conn.execute(select(JoinProgress.offset).where(*where)).scalar()  # type: ignore[attr-defined]
        if row is None:
            conn.execute(JoinProgress.__table__.insert(),  # type: ignore[attr-defined]
                         {"source": source, "partition": partition, "offset": offset})
        elif offset > row:
            conn.execute(update(JoinProgress).where(*where).values(offset=offset))  # type: ignore[attr-defined]
