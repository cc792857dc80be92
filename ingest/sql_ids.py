"""Lookups by many ids: `IN (...)` in chunks, through one expanding bind parameter; and
many-row INSERTs of plain tuples through the driver.

Shared by the join's state (`ingest.join_state`) and the feedback receipt ledger
(`app.feedback_intake`). Defines no tables, so importing it registers nothing in SQLModel's
metadata.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from sqlalchemy import BindParameter, Connection, bindparam, select

CHUNK = 5000  # ids per IN (...): under SQLite's and PostgreSQL's parameter limits
# `column.in_(IDS)`, executed with {"ids": [...]}: one cached statement whatever the list's
# length (a literal list compiles anew on every call)
IDS: BindParameter[list[str]] = bindparam("ids", expanding=True)


def chunks(ids: Iterable[str]) -> Iterator[list[str]]:
    """The distinct ids, sorted, in lists of at most CHUNK."""
    wanted = sorted(set(ids))
    for start in range(0, len(wanted), CHUNK):
        yield wanted[start:start + CHUNK]


def existing_ids(conn: Connection, column: Any, ids: Iterable[str]) -> set[str]:
    """The values among `ids` that `column` (a string column) holds."""
    found: set[str] = set()
    for chunk in chunks(ids):
        found.update(conn.execute(select(column).where(column.in_(IDS)), {"ids": chunk})
                     .scalars())
    return found


def insert_rows(conn: Connection, table: str, columns: Sequence[str],
                rows: Sequence[tuple[Any, ...]], *, skip_existing: bool = False) -> None:
    """INSERT `rows` (tuples in `columns` order) through the driver, one executemany:
    SQLAlchemy's per-row parameter processing cost more than the insert itself. Values must
    be what the driver takes (no type processing). `skip_existing`: rows whose key is stored
    already are skipped (ON CONFLICT DO NOTHING), else they fail."""
    if rows:
        marks = ", ".join(["?" if conn.dialect.paramstyle == "qmark" else "%s"] * len(columns))
        conn.exec_driver_sql(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})"
                             + (" ON CONFLICT DO NOTHING" if skip_existing else ""),
                             list(rows))  # type: ignore[arg-type]
