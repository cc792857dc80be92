"""Session verdicts' SQL state, in the join's database (`ingest.join_state.open_state`).

Three tables, new with session verdicts, so a join database from before them opens unchanged
and gains them (`ingest.sql_tables.create_tables` creates the missing ones):
- `join_session_turn`: session_id -> generation_id, created_at, for every logged generation
  that carries a session id. Sessions are keyed and partitioned by generation_id, so one
  session's generations are spread over partitions and join members; this shared table is
  where a verdict's owner finds them all. Rows go with their `join_session` rows.
- `join_verdict`: every session verdict's event id (its dedupe ledger) and its state: pending
  (its FeedbackReceived JSON kept until it is expanded), expanded, or expired. `source` is its
  input partition (`feedback` is keyed by session_id for verdicts), whose owner expands it.
  Only pending rows are indexed beyond the key.
- `join_outbox_turn`: for an outbox batch that holds experiences of session verdicts, which
  generation and turn each is; read back with the batch (`ingest.join_state.unproduced`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import BigInteger, Index, Text, delete, select, text, update
from sqlmodel import Column, Field, SQLModel, col

from ingest.events import FeedbackReceived, GenerationLogged
from ingest.experience_json import Turn
from ingest.log import list_adapter
from ingest.sql_ids import IDS, chunks, existing_ids, insert_rows

PENDING, EXPANDED, EXPIRED = "pending", "expanded", "expired"
_IS_PENDING = text("state = 'pending'")


class JoinSessionTurn(SQLModel, table=True):
    """A logged generation of session `session_id`, generated at `created_at` (unix s)."""

    __tablename__ = "join_session_turn"

    generation_id: str = Field(primary_key=True, max_length=128)
    # unbounded: GenerationLogged sets no limit, and a longer id must not fail the insert
    session_id: str = Field(sa_column=Column(Text, nullable=False, index=True))
    created_at: float


class JoinVerdict(SQLModel, table=True):
    """A session verdict the join has seen, and what became of it."""

    __tablename__ = "join_verdict"
    __table_args__ = (
        Index("ix_join_verdict_pending_since", "first_seen",
              sqlite_where=_IS_PENDING, postgresql_where=_IS_PENDING),
    )

    event_id: str = Field(primary_key=True, max_length=128)
    session_id: str = Field(max_length=128)
    source: int  # its input partition: the member that owns it expands it
    payload: str = Field(sa_column=Column(Text, nullable=False))  # '' once not pending
    first_seen: float
    state: str = Field(default=PENDING, max_length=16)


class JoinOutboxTurn(SQLModel, table=True):
    """The session verdicts' experiences of outbox batch (`source`, `seq`): `turns`, a JSON
    array parallel to the batch's feedback, each null (feedback about one generation) or
    [generation_id, turn, turns]. Only batches holding such experiences have a row."""

    __tablename__ = "join_outbox_turn"

    source: int = Field(primary_key=True)
    seq: int = Field(sa_column=Column(BigInteger, primary_key=True, autoincrement=False))
    turns: str = Field(sa_column=Column(Text, nullable=False))


SESSION_TABLES = [JoinSessionTurn.__table__, JoinVerdict.__table__,  # type: ignore[attr-defined]
                  JoinOutboxTurn.__table__]  # type: ignore[attr-defined]


def as_utc(moment: datetime) -> datetime:
    """`moment`, a naive one read as UTC: producers may send times without a zone, and
    comparing naive with aware times raises."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def store_turns(conn: Any, sessions: Iterable[GenerationLogged]) -> None:
    """Index the generations of `sessions` that carry a session id (known ones are skipped)."""
    rows = [(s.generation_id, s.session_id, as_utc(s.created_at).timestamp())
            for s in sessions if s.session_id is not None]
    insert_rows(conn, str(JoinSessionTurn.__tablename__),
                ("generation_id", "session_id", "created_at"), rows, skip_existing=True)


def store_verdicts(conn: Any, verdicts: Sequence[tuple[FeedbackReceived, bytes, int]],
                   now: float) -> list[FeedbackReceived]:
    """Store the verdicts (event, JSON as received, input partition) not seen before, pending;
    returns those (the others are duplicates of at-least-once delivery)."""
    known = existing_ids(conn, JoinVerdict.event_id, [v.event_id for v, _, _ in verdicts])
    fresh = [(v, raw, source) for v, raw, source in verdicts if v.event_id not in known]
    insert_rows(conn, str(JoinVerdict.__tablename__),
                ("event_id", "session_id", "source", "payload", "first_seen", "state"),
                [(v.event_id, v.key, source, raw.decode(), now, PENDING)
                 for v, raw, source in fresh], skip_existing=True)
    return [v for v, _, _ in fresh]


class PendingVerdict(NamedTuple):
    """A stored verdict not expanded yet."""

    verdict: FeedbackReceived
    payload: str  # as received
    source: int
    first_seen: float


def pending_verdicts(conn: Any, sources: Collection[int]) -> list[PendingVerdict]:
    """The pending verdicts of input partitions `sources`, oldest first."""
    rows = conn.execute(
        select(col(JoinVerdict.payload), col(JoinVerdict.source), col(JoinVerdict.first_seen))
        .where(_IS_PENDING, col(JoinVerdict.source).in_(sorted(sources)))
        .order_by(col(JoinVerdict.first_seen))).tuples().all()
    verdicts = _decoded([payload for payload, _, _ in rows])
    return [PendingVerdict(v, payload, source, first_seen)
            for v, (payload, source, first_seen) in zip(verdicts, rows, strict=True)]


def _decoded(payloads: Sequence[str]) -> list[FeedbackReceived]:
    """Verdicts this join stored after decoding them once: an error here is a bug, raised."""
    if not payloads:
        return []
    return list_adapter(FeedbackReceived).validate_json("[" + ",".join(payloads) + "]")


def session_generations(conn: Any, session_ids: Collection[str]) -> dict[str, list[str]]:
    """The generation ids indexed for each of `session_ids` (those with none are absent)."""
    found: dict[str, list[str]] = {}
    for chunk in chunks(session_ids):
        for session_id, generation_id in conn.execute(
                select(col(JoinSessionTurn.session_id), col(JoinSessionTurn.generation_id))
                .where(col(JoinSessionTurn.session_id).in_(IDS)), {"ids": chunk}):
            found.setdefault(session_id, []).append(generation_id)
    return found


def claim_verdicts(conn: Any, event_ids: Collection[str]) -> set[str]:
    """Mark pending verdicts `event_ids` expanded; returns those this call moved (a member
    that claimed one first keeps it, so each verdict is expanded once)."""
    claimed: set[str] = set()
    for chunk in chunks(event_ids):
        claimed.update(conn.execute(
            update(JoinVerdict).where(_IS_PENDING, col(JoinVerdict.event_id).in_(IDS))
            .values(state=EXPANDED, payload="").returning(col(JoinVerdict.event_id)),
            {"ids": chunk}).scalars())
    return claimed


def stale_verdicts(conn: Any, cutoff: float) -> list[tuple[str, str, str]]:
    """(event id, session id, payload) of the verdicts pending since before `cutoff`."""
    return conn.execute(
        select(col(JoinVerdict.event_id), col(JoinVerdict.session_id),
               col(JoinVerdict.payload))
        .where(_IS_PENDING, col(JoinVerdict.first_seen) < cutoff)).tuples().all()


def expire_verdicts(conn: Any, event_ids: Collection[str]) -> None:
    """Pending verdicts `event_ids` timed out (their dead letters are sent); one a member
    expanded meanwhile stays expanded."""
    for chunk in chunks(event_ids):
        conn.execute(update(JoinVerdict).where(_IS_PENDING, col(JoinVerdict.event_id).in_(IDS))
                     .values(state=EXPIRED, payload=""), {"ids": chunk})


def forget_turns(conn: Any, generation_ids: Collection[str]) -> None:
    """Drop the index rows of generations whose sessions are forgotten (expired)."""
    for chunk in chunks(generation_ids):
        conn.execute(delete(JoinSessionTurn).where(
            col(JoinSessionTurn.generation_id).in_(IDS)), {"ids": chunk})


class TurnRow(NamedTuple):
    """A join_outbox_turn row, in column order."""

    source: int
    seq: int
    turns: str  # a JSON array: null or [generation_id, turn, turns] per experience


def turn_row(source: int, seq: int, turns: Sequence[tuple[str, Turn] | None]
             ) -> TurnRow | None:
    """The turns of batch (`source`, `seq`), one per experience: (generation id, turn) of a
    session verdict's, None for feedback about one generation; None if the batch has none."""
    if all(t is None for t in turns):
        return None
    return TurnRow(source, seq, json.dumps([None if t is None else [t[0], *t[1]]
                                            for t in turns]))


def paid_generations(generation_ids: Sequence[str | None], turns: str | None
                     ) -> list[tuple[str, Turn | None]]:
    """Per experience of an outbox batch, the generation it pays and its turn: a generation
    verdict pays its own `generation_id` (turn None); a session verdict's experience pays the
    generation its join_outbox_turn entry names. `turns`: the batch's join_outbox_turn array
    (None: the batch has no row)."""
    entries = [None] * len(generation_ids) if turns is None else json.loads(turns)
    out: list[tuple[str, Turn | None]] = []
    for generation_id, entry in zip(generation_ids, entries, strict=True):
        if entry is not None:
            out.append((entry[0], Turn(entry[1], entry[2])))
        elif generation_id is None:
            raise ValueError("a session verdict's experience has no join_outbox_turn entry")
        else:
            out.append((generation_id, None))
    return out
