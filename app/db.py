"""SQL state: SQLite under the data dir by default, PostgreSQL by URL (SQLModel).

Tables here are the system's memory that must survive restarts: feedback receipts (the
webhook's idempotency record), the model versions a process has served, and releases.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from sqlalchemy import JSON, Column, Engine
from sqlmodel import Field, SQLModel

from ingest.events import utcnow
from ingest.sql import open_database


class FeedbackReceipt(SQLModel, table=True):
    """One accepted feedback event; a repeated event_id is acknowledged but not produced."""

    event_id: str = Field(primary_key=True, max_length=128)
    # no index: nothing looks receipts up by generation (the join keeps its own state), and
    # a second B-tree doubled the insert's cost (10.8 -> 5.0 us per row on SQLite)
    generation_id: str = Field(max_length=128)
    kind: str = Field(max_length=32)
    received_at: datetime = Field(default_factory=utcnow)


class ServedVersion(SQLModel, table=True):
    """A model version a serving process has loaded (number + weights sha256)."""

    number: int = Field(primary_key=True)
    sha256: str = Field(max_length=64)
    first_served_at: datetime = Field(default_factory=utcnow)


ReleaseStatus = Literal["candidate", "published", "rejected", "rolled_back"]


class Release(SQLModel, table=True):
    """One release candidate and what became of it (app/releases.py writes it).

    `manifest_uri` is the delta from `parent`; snapshots also have `snapshot_uri` and reset
    `chain_length` to 0. The online trainer (#7) fills the provenance columns: the step range
    and the generation and feedback event ids the weights were trained on.
    """

    version: int = Field(primary_key=True)
    parent: int | None = Field(default=None, index=True)
    kind: str = Field(max_length=16)  # delta | snapshot
    status: str = Field(default="candidate", max_length=16, index=True)
    sha256: str = Field(max_length=64)
    manifest_uri: str | None = None
    snapshot_uri: str | None = None
    candidate_uri: str | None = None
    chain_length: int = 0
    requested_by: str = Field(default="system", max_length=128)
    reason: str = Field(default="", max_length=2000)
    eval_summary: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    step_range: list[int] | None = Field(default=None, sa_column=Column(JSON))
    generation_ids: list[str] = Field(default_factory=list, sa_column=Column(JSON))
    feedback_event_ids: list[str] = Field(default_factory=list, sa_column=Column(JSON))
    created_at: datetime = Field(default_factory=utcnow)
    published_at: datetime | None = None
    rolled_back_at: datetime | None = None
    rolled_back_by: str | None = Field(default=None, max_length=128)
    rollback_reason: str | None = Field(default=None, max_length=2000)


def make_db_engine(url: str) -> Engine:
    """Create the engine and the tables (idempotent; `ingest.sql.open_database`)."""
    return open_database(url)
