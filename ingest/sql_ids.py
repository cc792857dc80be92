"""Lookups by many ids, `IN (...)` in chunks; many-row INSERTs of plain tuples; and the
expanding bind parameter for the statements that stay in SQLAlchemy's expression language.

Shared by the join's state (`ingest.join_state`) and the feedback receipt ledger
(`app.feedback_intake`). Defines no tables, so importing it registers nothing in SQLModel's
metadata.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from sqlalchemy import BindParameter, Connection, bindparam

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
    """The values among `ids` that `column` (a string column) holds. Through the driver, with
    one placeholder per id: SQLAlchemy's rendering of an expanding parameter doubled the cost
    per id (2.3 against 1.2 µs on SQLite, docs/feedback.md)."""
    found: set[str] = set()
    select_sql = f"SELECT {column.name} FROM {column.table.name} WHERE {column.name} IN "
    for chunk in chunks(ids):
        rows = conn.exec_driver_sql(select_sql + _marks(conn, len(chunk)), tuple(chunk))
        found.update(row[0] for row in rows)
    return found


def _marks(conn: Connection, count: int) -> str:
    """`(?, ?, …)`: `count` positional placeholders in the driver's style."""
    return "(" + ", ".join(["?" if conn.dialect.paramstyle == "qmark" else "%s"] * count) + ")"


def insert_rows(conn: Connection, table: str, columns: Sequence[str],
                rows: Sequence[tuple[Any, ...]], *, skip_existing: bool = False) -> None:
    """INSERT `rows` (tuples in `columns` order) through the driver, one executemany:
    SQLAlchemy's per-row parameter processing cost more than the insert itself. Values must
    be what the driver takes (no type processing). `skip_existing`: rows whose key is stored
    already are skipped (ON CONFLICT DO NOTHING), else they fail."""
    if rows:
        conn.exec_driver_sql(f"INSERT INTO {table} ({', '.join(columns)}) VALUES "
                             f"{_marks(conn, len(columns))}"
                             + (" ON CONFLICT DO NOTHING" if skip_existing else ""),
                             list(rows))  # type: ignore[arg-type]
