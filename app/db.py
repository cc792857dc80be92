"""SQL state: SQLite under the data dir by default, PostgreSQL by URL (SQLModel).

Tables here are the system's memory that must survive restarts: feedback receipts (the
idempotency ledger of the webhook) and the model versions a process has served.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Engine
from sqlmodel import Field, SQLModel, create_engine

from ingest.events import utcnow


class FeedbackReceipt(SQLModel, table=True):
    """One accepted feedback event; a repeated event_id is acknowledged but not produced."""

    event_id: str = Field(primary_key=True, max_length=128)
    generation_id: str = Field(index=True, max_length=128)
    kind: str = Field(max_length=32)
    received_at: datetime = Field(default_factory=utcnow)


class ServedVersion(SQLModel, table=True):
    """A model version a serving process has loaded (number + weights sha256)."""

    number: int = Field(primary_key=True)
    sha256: str = Field(max_length=64)
    first_served_at: datetime = Field(default_factory=utcnow)


def make_db_engine(url: str) -> Engine:
    """Create the engine and the tables (idempotent)."""
    connect_args = {"check_same_thread": False} if url.startswith("sqlite") else {}
    engine = create_engine(url, connect_args=connect_args, pool_pre_ping=True)
    SQLModel.metadata.create_all(engine)
    return engine
