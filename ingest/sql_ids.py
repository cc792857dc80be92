"""Lookups by many ids: `IN (...)` in chunks, through one expanding bind parameter.

Shared by the join's state (`ingest.join_state`) and the feedback receipt ledger
(`app.feedback_intake`). Defines no tables, so importing it registers nothing in SQLModel's
metadata.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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
