"""SQL state: SQLite under the data dir by default, PostgreSQL by URL (SQLModel).

Tables here are the API's memory that must survive restarts: feedback receipts (the
webhook's idempotency record), the model versions a process has served, which replica
serves which version now, the inference keys (app/api/api_keys.py), and the record of each
user's deletion (`UserDeletion`, ingest/deletions.py: the trainer reads it too). The release
history is the release pipeline's table (trainer/release/pipeline.py), the trainer's control queue
trainer/online/control.py's.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Engine
from sqlmodel import Field, SQLModel

from ingest.deletions import UserDeletion
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


class ReplicaSeen(SQLModel, table=True):
    """A serving process and the version it serves, as it last said (app/api/replicas.py)."""

    __tablename__ = "replica"
    replica_id: str = Field(primary_key=True, max_length=200)
    version: int
    sha256: str = Field(max_length=64)
    seen_at: datetime = Field(default_factory=utcnow)


class ApiKey(SQLModel, table=True):
    """An inference key: its public id, the sha256 of its secret (the secret itself is shown
    once, when made, and kept nowhere), the user it speaks for, its request rate limit."""

    __tablename__ = "api_key"
    key_id: str = Field(primary_key=True, max_length=32)
    secret_sha256: str = Field(max_length=64)
    user_id: str = Field(max_length=128, index=True)
    rps: float | None = None  # requests per second; None: no limit
    private: bool = False  # every request in privacy mode (else a request may ask for it)
    label: str | None = Field(default=None, max_length=200)
    created_at: datetime = Field(default_factory=utcnow)
    revoked_at: datetime | None = None


__all__ = ["ApiKey", "FeedbackReceipt", "ReplicaSeen", "ServedVersion", "UserDeletion",
           "make_db_engine"]


def make_db_engine(url: str) -> Engine:
    """Create the engine and the tables (idempotent; `ingest.sql.open_database`)."""
    return open_database(url)
