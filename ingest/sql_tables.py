"""Creating tables when several processes may start at once on one database.

SQLAlchemy's `create_all` checks whether each table exists, then creates the missing ones. Two
processes starting together on a fresh PostgreSQL database (two `flywheel join` members, two
API workers) can both find a table missing; the second CREATE then fails on the catalog's
unique index (`duplicate key value violates unique constraint "pg_type_typname_nsp_index"`)
and that process dies at start. PostgreSQL's DDL is transactional, so `create_tables` runs
the check and the creation in one transaction that first takes an advisory lock: the second
process waits for the first to commit, then finds every table there.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Engine, Table, text
from sqlmodel import SQLModel

# pg_advisory_xact_lock's key for table creation, one for every Flywheel table ("Flyw")
SCHEMA_LOCK = 0x466C7977


def create_tables(engine: Engine, tables: Sequence[Table] | None = None) -> None:
    """`SQLModel.metadata.create_all` for `tables` (all registered when None), safe when
    processes race: on PostgreSQL under a transaction-scoped advisory lock."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK})
        SQLModel.metadata.create_all(conn, tables=tables)
