"""Flywheel's SQL databases: one place for engines, table creation and dialect differences.

SQLite under the data dir by default, PostgreSQL by URL. Every process opens its database with
`open_database`, which is the only code that knows one dialect from the other:
- SQLite: WAL (readers never wait on the writer) with synchronous=NORMAL (a commit survives
  the process dying; a machine crash may lose the last ones, which Kafka re-delivers), a busy
  timeout, and `BEGIN IMMEDIATE`: several processes (two join members, API workers) share one
  file, and a deferred transaction whose read turns into a write fails with SQLITE_BUSY that no
  timeout can wait out, so every transaction takes the write lock when it begins
  (SQLAlchemy's documented recipe for pysqlite).
- PostgreSQL: connections are checked before use; tables are created under an advisory lock
  (`create_tables`).

Also the bulk helpers the ingest paths share: lookups by many ids and many-row INSERTs of
plain tuples through the driver (SQLAlchemy's per-row parameter processing cost more than
the insert itself).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from sqlalchemy import BindParameter, Connection, Engine, Table, bindparam, event, text
from sqlmodel import SQLModel, create_engine

CHUNK = 5000  # ids per IN (...): under SQLite's and PostgreSQL's parameter limits
# `column.in_(IDS)`, executed with {"ids": [...]}: one cached statement whatever the list's
# length (a literal list compiles anew on every call)
IDS: BindParameter[list[str]] = bindparam("ids", expanding=True)
# pg_advisory_xact_lock's key for table creation, one for every Flywheel table ("Flyw")
SCHEMA_LOCK = 0x466C7977


def open_database(url: str, tables: Sequence[Table] | None = None) -> Engine:
    """An engine on `url` with the dialect's settings (module doc), and `tables` created
    (every table SQLModel has registered when None; idempotent)."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _sqlite_connected)
        event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    else:
        engine = create_engine(url, pool_pre_ping=True)
    create_tables(engine, tables)
    return engine


def _sqlite_connected(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.isolation_level = None  # the driver's own BEGIN off: the "begin" event's instead
    cursor = dbapi_conn.cursor()
    # the busy timeout first: switching to WAL takes a lock, and a process starting while
    # another writes (a join member restarted beside its peer) waited the driver's 5 s for it,
    # then failed with "database is locked"
    for pragma in ("busy_timeout=30000", "journal_mode=WAL", "synchronous=NORMAL",
                   # 64 MiB of page cache, not 2: the indexes of feedback event ids (random)
                   # grow for good, and past the cache each insert reads pages back
                   "cache_size=-65536"):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


def create_tables(engine: Engine, tables: Sequence[Table] | None = None) -> None:
    """`SQLModel.metadata.create_all` for `tables` (all registered when None), safe when
    processes start together: two processes on a fresh PostgreSQL database could both find a
    table missing, and the second CREATE would fail on the catalog's unique index. PostgreSQL's
    DDL is transactional, so the check and the creation run in one transaction under an
    advisory lock: the second process waits for the first, then finds every table there."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK})
        SQLModel.metadata.create_all(conn, tables=tables)


def chunks(ids: Iterable[str]) -> Iterator[list[str]]:
    """The distinct ids, sorted, in lists of at most CHUNK."""
    wanted = sorted(set(ids))
    for start in range(0, len(wanted), CHUNK):
        yield wanted[start:start + CHUNK]


def existing_ids(conn: Connection, column: Any, ids: Iterable[str]) -> set[str]:
    """The values among `ids` that `column` (a string column) holds."""
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
    """INSERT `rows` (tuples in `columns` order) through the driver, one executemany. Values
    must be what the driver takes (no type processing). `skip_existing`: rows whose key is
    stored already are skipped (ON CONFLICT DO NOTHING), else they fail."""
    if rows:
        conn.exec_driver_sql(f"INSERT INTO {table} ({', '.join(columns)}) VALUES "
                             f"{_marks(conn, len(columns))}"
                             + (" ON CONFLICT DO NOTHING" if skip_existing else ""),
                             list(rows))  # type: ignore[arg-type]
