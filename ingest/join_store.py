"""The join's memory in SQL (`ingest.sql.open_database`: SQLite under the data dir by default,
PostgreSQL by URL, shared by every member of the join's group).

- `join_session`: sessions seen (the GenerationLogged JSON), until they expire; `matched`
  once an experience came of one (its expiry is then no loss).
- `join_feedback`: every feedback event id ever seen (for dedupe) and its state:
  pending (no session yet: its FeedbackReceived JSON kept for the match), matched, or
  expired. Only pending rows are indexed beyond the key: the table grows with every event,
  the lookups are all of pending ones.
- `join_session_turn`: session_id -> generation_id, created_at for every generation that
  carries a session id: sessions are partitioned by generation_id, so one agent session's
  generations are spread over partitions and members; here a verdict's owner finds them all.
- `join_verdict`: every session verdict's event id (for dedupe) and its state:
  pending (its JSON kept), expanded or expired; `source` is its input partition, whose owner
  expands it.
- `join_session_user`: generation_id -> user_id, session_id, created_at for every generation
  that names a user; kept after its session expires (the topics keep records longer than the
  join keeps sessions), so a user's deletion finds every key of theirs to tombstone.
- `join_forgotten`: per deleted user, the time before which their generations are forgotten:
  a session of theirs arriving late (generated before it) is dropped on arrival, with the
  feedback waiting for it (`ingest.deletions`).
- `join_progress`: per input partition (`source`) and experiences partition, the highest
  offset of an experience of that source the broker acknowledged, written in the transaction
  that stores the matches: after a crash, the new owner of the source reads the experiences
  topic from there (`Join`'s recovery scan).

Claims (`UPDATE … WHERE state = 'pending' RETURNING`) decide which member turns a pending
row into experiences when two race for it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple, TypeVar

from pydantic import BaseModel
from sqlalchemy import Connection, Index, Text, delete, insert, select, text, update
from sqlmodel import Column, Field, SQLModel, col

from ingest.events import FeedbackReceived, GenerationLogged
from ingest.log import list_adapter
from ingest.sql import IDS, chunks, existing_ids, insert_rows

PENDING, MATCHED, EXPANDED, EXPIRED = "pending", "matched", "expanded", "expired"
DELETED = "deleted"  # its user's data was deleted before it could be matched
IS_PENDING = text("state = 'pending'")
E = TypeVar("E", bound=BaseModel)


class JoinSession(SQLModel, table=True):
    __tablename__ = "join_session"

    generation_id: str = Field(primary_key=True, max_length=128)
    payload: str = Field(sa_column=Column(Text, nullable=False))
    first_seen: float = Field(index=True)
    matched: bool = False


class JoinFeedback(SQLModel, table=True):
    __tablename__ = "join_feedback"
    __table_args__ = (
        Index("ix_join_feedback_pending_generation", "generation_id",
              sqlite_where=IS_PENDING, postgresql_where=IS_PENDING),
        Index("ix_join_feedback_pending_since", "first_seen",
              sqlite_where=IS_PENDING, postgresql_where=IS_PENDING),
    )

    event_id: str = Field(primary_key=True, max_length=128)
    generation_id: str = Field(max_length=128)
    payload: str = Field(sa_column=Column(Text, nullable=False))  # '' if matched on arrival
    first_seen: float
    state: str = Field(default=PENDING, max_length=16)


class JoinSessionTurn(SQLModel, table=True):
    __tablename__ = "join_session_turn"

    generation_id: str = Field(primary_key=True, max_length=128)
    # unbounded: GenerationLogged sets no limit, and a longer id must not fail the insert
    session_id: str = Field(sa_column=Column(Text, nullable=False, index=True))
    created_at: float  # unix seconds


class JoinVerdict(SQLModel, table=True):
    __tablename__ = "join_verdict"
    __table_args__ = (
        Index("ix_join_verdict_pending_since", "first_seen",
              sqlite_where=IS_PENDING, postgresql_where=IS_PENDING),
    )

    event_id: str = Field(primary_key=True, max_length=128)
    session_id: str = Field(max_length=128)
    source: int
    payload: str = Field(sa_column=Column(Text, nullable=False))  # '' once not pending
    first_seen: float
    state: str = Field(default=PENDING, max_length=16)


class JoinSessionUser(SQLModel, table=True):
    __tablename__ = "join_session_user"

    generation_id: str = Field(primary_key=True, max_length=128)
    user_id: str = Field(sa_column=Column(Text, nullable=False, index=True))
    session_id: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    created_at: float  # unix seconds


class JoinForgotten(SQLModel, table=True):
    __tablename__ = "join_forgotten"

    user_id: str = Field(sa_column=Column(Text, primary_key=True))
    before: float  # unix seconds: generations of this user created up to then are forgotten
    requested_at: float


class JoinProgress(SQLModel, table=True):
    __tablename__ = "join_progress"

    source: int = Field(primary_key=True)
    partition: int = Field(primary_key=True)
    offset: int


TABLES = [SQLModel.metadata.tables[name] for name in (
    "join_session", "join_feedback", "join_session_turn", "join_verdict", "join_session_user",
    "join_forgotten", "join_progress")]


def as_utc(moment: datetime) -> datetime:
    """`moment`, a naive one read as UTC: producers may send times without a zone, and
    comparing naive with aware times raises."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def decoded(event_type: type[E], payloads: Sequence[str]) -> list[E]:
    """Payloads the join stored after decoding them once: an error here is a bug, raised."""
    if not payloads:
        return []
    return list_adapter(event_type).validate_json("[" + ",".join(payloads) + "]")


def rows_in(conn: Connection, statement: Any, ids: Iterable[str]) -> list[Any]:
    """The rows of `statement` (whose WHERE holds `column.in_(IDS)`) over `ids`, chunked."""
    return [row for chunk in chunks(ids) for row in conn.execute(statement, {"ids": chunk})]


# ---- sessions ---------------------------------------------------------------------------
class SessionRow(NamedTuple):
    generation_id: str
    payload: str
    first_seen: float
    matched: bool


def add_sessions(conn: Connection, rows: Sequence[SessionRow],
                 sessions: Sequence[GenerationLogged]) -> None:
    """Store new sessions (known ones are skipped) and index those of agent sessions and
    those that name a user."""
    insert_rows(conn, "join_session", SessionRow._fields, rows, skip_existing=True)
    insert_rows(conn, "join_session_turn", ("generation_id", "session_id", "created_at"),
                [(s.generation_id, s.session_id, as_utc(s.created_at).timestamp())
                 for s in sessions if s.session_id is not None], skip_existing=True)
    insert_rows(conn, "join_session_user",
                ("generation_id", "user_id", "session_id", "created_at"),
                [(s.generation_id, s.user_id, s.session_id, as_utc(s.created_at).timestamp())
                 for s in sessions if s.user_id is not None], skip_existing=True)


def stored_sessions(conn: Connection, generation_ids: Collection[str]
                    ) -> dict[str, GenerationLogged]:
    """The stored sessions among `generation_ids`, decoded."""
    rows = rows_in(conn, select(col(JoinSession.payload)).where(
        col(JoinSession.generation_id).in_(IDS)), generation_ids)
    return {s.generation_id: s for s in decoded(GenerationLogged, [p for p, in rows])}


def sessions_matched(conn: Connection, generation_ids: Collection[str]) -> None:
    """Stored sessions `generation_ids` yielded an experience."""
    for chunk in chunks(generation_ids):
        conn.execute(update(JoinSession).where(
            col(JoinSession.generation_id).in_(IDS), ~col(JoinSession.matched))
            .values(matched=True), {"ids": chunk})


def stale_sessions(conn: Connection, cutoff: float) -> list[tuple[str, str, bool]]:
    """(generation id, payload, matched) of the sessions first seen before `cutoff`."""
    return list(conn.execute(
        select(col(JoinSession.generation_id), col(JoinSession.payload),
               col(JoinSession.matched))
        .where(col(JoinSession.first_seen) < cutoff)).tuples())


def forget_sessions(conn: Connection, generation_ids: Collection[str]) -> int:
    """Delete the stored sessions `generation_ids` (expired, or their user's data deleted) and
    their turn index rows; returns how many sessions were stored."""
    deleted = 0
    for chunk in chunks(generation_ids):
        deleted += conn.execute(delete(JoinSession).where(
            col(JoinSession.generation_id).in_(IDS)), {"ids": chunk}).rowcount
        conn.execute(delete(JoinSessionTurn).where(
            col(JoinSessionTurn.generation_id).in_(IDS)), {"ids": chunk})
    return deleted


# ---- feedback about one generation ------------------------------------------------------
class FeedbackRow(NamedTuple):
    event_id: str
    generation_id: str
    payload: str
    first_seen: float
    state: str


def unseen_feedback(conn: Connection, event_ids: Collection[str]) -> set[str]:
    """The ids among `event_ids` never seen before."""
    return set(event_ids) - existing_ids(conn, col(JoinFeedback.event_id), event_ids)


def add_feedback(conn: Connection, rows: Sequence[FeedbackRow]) -> None:
    insert_rows(conn, "join_feedback", FeedbackRow._fields, rows, skip_existing=True)


def claim_feedback(conn: Connection, column: Any, ids: Collection[str]
                   ) -> list[FeedbackReceived]:
    """Claim the pending feedback whose `column` (`JoinFeedback.generation_id`: the feedback
    waiting for these sessions; `JoinFeedback.event_id`: these events) is among `ids`, marking
    it matched; returns what this call moved, decoded (a member that claimed a row first
    keeps it, so each experience is made once)."""
    return decoded(FeedbackReceived, [p for p, in rows_in(conn, update(JoinFeedback).where(
        IS_PENDING, col(column).in_(IDS))
        .values(state=MATCHED).returning(col(JoinFeedback.payload)), ids)])


def pending_with_sessions(conn: Connection, keep: Callable[[str], bool]
                          ) -> list[tuple[str, GenerationLogged]]:
    """(event id, session) of the pending feedback whose session is stored after all, for the
    generation ids `keep` accepts: what two members leave behind when a partition moves
    between them mid-poll (each stored its half before seeing the other's)."""
    rows = [(e, s) for e, g, s in conn.execute(
        select(col(JoinFeedback.event_id), col(JoinFeedback.generation_id),
               col(JoinSession.payload)).join(
            JoinSession, col(JoinSession.generation_id) == col(JoinFeedback.generation_id))
        .where(IS_PENDING)) if keep(g)]
    return list(zip([e for e, _ in rows], decoded(GenerationLogged, [s for _, s in rows]),
                    strict=True))


# ---- session verdicts -------------------------------------------------------------------
class PendingVerdict(NamedTuple):
    verdict: FeedbackReceived
    source: int
    first_seen: float


def add_verdicts(conn: Connection, verdicts: Sequence[tuple[FeedbackReceived, bytes, int]],
                 now: float) -> list[FeedbackReceived]:
    """Store the verdicts (event, JSON as received, input partition) not seen before, pending;
    returns those (the others are duplicates of at-least-once delivery)."""
    known = existing_ids(conn, col(JoinVerdict.event_id), [v.event_id for v, _, _ in verdicts])
    fresh = [(v, raw, source) for v, raw, source in verdicts if v.event_id not in known]
    insert_rows(conn, "join_verdict",
                ("event_id", "session_id", "source", "payload", "first_seen", "state"),
                [(v.event_id, v.key, source, raw.decode(), now, PENDING)
                 for v, raw, source in fresh], skip_existing=True)
    return [v for v, _, _ in fresh]


def pending_verdicts(conn: Connection, sources: Collection[int]) -> list[PendingVerdict]:
    """The pending verdicts of input partitions `sources`, oldest first."""
    rows = conn.execute(
        select(col(JoinVerdict.payload), col(JoinVerdict.source), col(JoinVerdict.first_seen))
        .where(IS_PENDING, col(JoinVerdict.source).in_(sorted(sources)))
        .order_by(col(JoinVerdict.first_seen))).tuples().all()
    verdicts = decoded(FeedbackReceived, [payload for payload, _, _ in rows])
    return [PendingVerdict(v, source, first_seen)
            for v, (_, source, first_seen) in zip(verdicts, rows, strict=True)]


def session_generations(conn: Connection, session_ids: Collection[str]) -> dict[str, list[str]]:
    """The generation ids indexed for each of `session_ids` (those with none are absent)."""
    found: dict[str, list[str]] = {}
    for session_id, generation_id in rows_in(conn, select(
            col(JoinSessionTurn.session_id), col(JoinSessionTurn.generation_id))
            .where(col(JoinSessionTurn.session_id).in_(IDS)), session_ids):
        found.setdefault(session_id, []).append(generation_id)
    return found


def claim_verdicts(conn: Connection, event_ids: Collection[str]) -> set[str]:
    """Mark pending verdicts `event_ids` expanded; returns those this call moved."""
    return {e for e, in rows_in(conn, update(JoinVerdict).where(
        IS_PENDING, col(JoinVerdict.event_id).in_(IDS))
        .values(state=EXPANDED, payload="").returning(col(JoinVerdict.event_id)), event_ids)}


# ---- expiry -----------------------------------------------------------------------------
def stale_pending(conn: Connection, table: type[JoinFeedback] | type[JoinVerdict],
                  cutoff: float) -> list[tuple[str, str, str]]:
    """(event id, generation or session id, payload) of the feedback or verdicts of `table`
    pending since before `cutoff`."""
    key = JoinFeedback.generation_id if table is JoinFeedback else JoinVerdict.session_id
    return list(conn.execute(select(col(table.event_id), col(key), col(table.payload))
                             .where(IS_PENDING, col(table.first_seen) < cutoff)).tuples())


def expire_pending(conn: Connection, table: type[JoinFeedback] | type[JoinVerdict],
                   event_ids: Collection[str]) -> None:
    """Pending rows `event_ids` of `table` timed out (their dead letters are sent); one a
    member claimed meanwhile keeps its state."""
    for chunk in chunks(event_ids):
        conn.execute(update(table).where(IS_PENDING, col(table.event_id).in_(IDS))
                     .values(state=EXPIRED, payload=""), {"ids": chunk})


# ---- a user's deletion ------------------------------------------------------------------
def drop_feedback(conn: Connection, generation_ids: Collection[str]) -> int:
    """The feedback pending for `generation_ids`, whose user's data was deleted, marked
    deleted with its payload; returns how many."""
    return len(rows_in(conn, update(JoinFeedback).where(
        IS_PENDING, col(JoinFeedback.generation_id).in_(IDS))
        .values(state=DELETED, payload="").returning(col(JoinFeedback.event_id)),
        generation_ids))


def forgotten_among(conn: Connection, sessions: Iterable[GenerationLogged]) -> set[str]:
    """The generation ids among `sessions` whose user was deleted after generating them."""
    users = {s.user_id for s in sessions if s.user_id is not None}
    if not users:
        return set()
    before = dict(rows_in(conn, select(col(JoinForgotten.user_id), col(JoinForgotten.before))
                      .where(col(JoinForgotten.user_id).in_(IDS)), users))
    return {s.generation_id for s in sessions if s.user_id in before
            and as_utc(s.created_at).timestamp() <= before[s.user_id]}


def forgotten_since(conn: Connection, since: float) -> list[tuple[str, float]]:
    """(user id, before) of the deletions requested after `since`."""
    return list(conn.execute(select(col(JoinForgotten.user_id), col(JoinForgotten.before))
                             .where(col(JoinForgotten.requested_at) > since)).tuples())


# ---- progress on the experiences topic --------------------------------------------------
def record_progress(conn: Connection, offsets: dict[tuple[int, int], int]) -> None:
    """Raise the stored offset of each (source, experiences partition) to `offsets`'."""
    for (source, partition), offset in offsets.items():
        where = (col(JoinProgress.source) == source, col(JoinProgress.partition) == partition)
        stored = conn.execute(select(col(JoinProgress.offset)).where(*where)).scalar()
        if stored is None:
            conn.execute(insert(JoinProgress).values(source=source, partition=partition,
                                                     offset=offset))
        elif offset > stored:
            conn.execute(update(JoinProgress).where(*where).values(offset=offset))


def progress(conn: Connection, sources: Collection[int]) -> list[tuple[int, int, int]]:
    """(source, experiences partition, offset) stored for `sources`."""
    return list(conn.execute(
        select(col(JoinProgress.source), col(JoinProgress.partition), col(JoinProgress.offset))
        .where(col(JoinProgress.source).in_(sorted(sources)))).tuples())
