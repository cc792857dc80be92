"""How the API reaches the trainer process: two small SQL tables the trainer polls.

The API and the trainer are separate processes (possibly separate machines) that already
share the SQL database, so control is a command queue plus a status row there:

- `trainer_command`: POST /admin/trainer/pause|resume|release inserts a row; the trainer
  polls every `online.control_every_s`, applies the commands in id order and stamps them done.
  A command survives a trainer restart (it stays pending until a trainer handles it).
- `trainer_status`: one row the trainer upserts after each step and control poll (step,
  consumed, lag, paused, last release); GET /admin/status reads it.
- `monitor_breach`: a row per reward-hacking monitor that tripped (trainer/online/
  monitor_watch.py), with the sessions that showed it; GET /admin/trainer lists the newest.

Chosen over Kafka control messages because a command must be applied exactly once by
whichever trainer is alive, and the answer (status) is state to read, not a stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol

from sqlalchemy import JSON, Column, Engine
from sqlmodel import Field, Session, SQLModel, col, func, select

from ingest.events import utcnow
from ingest.sql import create_tables, open_database
from trainer.release.monitors import Breach

CommandKind = Literal["pause", "resume", "release"]
STATUS_ROW = 1


class TrainerControl(Protocol):
    """The online loop's side of the control channel (`SqlTrainerControl` is one)."""

    def pending(self) -> list[Any]: ...

    def done(self, command_id: int, result: dict[str, Any]) -> None: ...

    def publish(self, **fields: Any) -> None: ...

    def record_breaches(self, breaches: Sequence[Breach]) -> None: ...


class TrainerCommand(SQLModel, table=True):
    __tablename__ = "trainer_command"

    id: int | None = Field(default=None, primary_key=True)
    kind: str = Field(max_length=16)
    requested_by: str = Field(default="admin", max_length=128)
    reason: str = Field(default="", max_length=2000)
    created_at: datetime = Field(default_factory=utcnow)
    handled_at: datetime | None = Field(default=None, index=True)
    result: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))


class TrainerStatus(SQLModel, table=True):
    __tablename__ = "trainer_status"

    id: int = Field(default=STATUS_ROW, primary_key=True)
    step: int = 0
    consumed: int = 0
    lag: int | None = None
    paused: bool = False
    last_release_version: int | None = None
    last_release_step: int | None = None
    last_release_at: datetime | None = None
    metrics: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    updated_at: datetime = Field(default_factory=utcnow)


class MonitorBreachRow(SQLModel, table=True):
    """A reward-hacking monitor that tripped (trainer/release/monitors.py): the trainer paused
    and holds its releases until an admin resumes it."""

    __tablename__ = "monitor_breach"

    id: int | None = Field(default=None, primary_key=True)
    monitor: str = Field(max_length=64)
    version: int
    value: float
    baseline: float
    threshold: float
    sessions: list[str] = Field(default_factory=list, sa_column=Column(JSON))
    created_at: datetime = Field(default_factory=utcnow, index=True)


CONTROL_TABLES = [TrainerCommand.__table__, TrainerStatus.__table__,  # type: ignore[attr-defined]
                  MonitorBreachRow.__table__]  # type: ignore[attr-defined]


def ensure_control_tables(db: Engine) -> Engine:
    create_tables(db, CONTROL_TABLES)
    return db


def open_control_db(url: str) -> Engine:
    return open_database(url, CONTROL_TABLES)


def enqueue_command(db: Engine, kind: CommandKind, *, requested_by: str = "admin",
                    reason: str = "") -> int:
    with Session(db) as session:
        row = TrainerCommand(kind=kind, requested_by=requested_by, reason=reason)
        session.add(row)
        session.commit()
        session.refresh(row)
        assert row.id is not None
        return row.id


def read_status(db: Engine) -> TrainerStatus | None:
    with Session(db) as session:
        return session.get(TrainerStatus, STATUS_ROW)


def recent_breaches(db: Engine, limit: int = 20) -> list[MonitorBreachRow]:
    """The newest breaches first."""
    with Session(db) as session:
        return list(session.exec(select(MonitorBreachRow)
                                 .order_by(col(MonitorBreachRow.id).desc()).limit(limit)).all())


def breach_counts(db: Engine) -> dict[str, int]:
    """Breaches so far, by monitor."""
    with Session(db) as session:
        rows = session.exec(select(MonitorBreachRow.monitor, func.count())
                            .group_by(col(MonitorBreachRow.monitor))).all()
        return {monitor: count for monitor, count in rows}


@dataclass(frozen=True)
class PendingCommand:
    id: int
    kind: str
    requested_by: str
    reason: str


class SqlTrainerControl:
    """The trainer's side: take pending commands, mark them handled, publish status."""

    def __init__(self, db: Engine) -> None:
        self.db = db

    def pending(self) -> list[PendingCommand]:
        with Session(self.db) as session:
            rows = session.exec(select(TrainerCommand)
                                .where(col(TrainerCommand.handled_at).is_(None))
                                .order_by(col(TrainerCommand.id))).all()
            return [PendingCommand(r.id or 0, r.kind, r.requested_by, r.reason) for r in rows]

    def done(self, command_id: int, result: dict[str, Any]) -> None:
        with Session(self.db) as session:
            row = session.get(TrainerCommand, command_id)
            if row is not None:
                row.handled_at, row.result = utcnow(), result
                session.add(row)
                session.commit()

    def publish(self, **fields: Any) -> None:
        with Session(self.db) as session:
            row = session.get(TrainerStatus, STATUS_ROW) or TrainerStatus()
            row.sqlmodel_update({**fields, "updated_at": utcnow()})
            session.add(row)
            session.commit()

    def record_breaches(self, breaches: Sequence[Breach]) -> None:
        with Session(self.db) as session:
            session.add_all(MonitorBreachRow(
                monitor=b.monitor, version=b.version, value=b.value, baseline=b.baseline,
                threshold=b.threshold, sessions=list(b.sessions)) for b in breaches)
            session.commit()
