"""Table creation when processes start together on one fresh PostgreSQL database."""

from __future__ import annotations

import threading

from sqlalchemy import create_engine, inspect
from sqlmodel import SQLModel

import app.db  # noqa: F401  # registers the API's tables
import ingest.join_store  # noqa: F401  # the join's
import trainer.online.control  # noqa: F401  # the online trainer's control tables
from ingest.sql import create_tables


def test_processes_starting_together_create_the_tables_once(postgres_schema: str) -> None:
    """Two members starting at once (threads with their own connections, released together):
    plain `create_all` fails one of them on the catalog's unique index nearly every time; with
    the advisory lock both start and every table exists."""
    engines = [create_engine(postgres_schema) for _ in range(2)]
    for engine in engines:
        engine.connect().close()  # connected before the start, as a running process is
    start, errors = threading.Barrier(len(engines)), []

    def member(engine: object) -> None:
        start.wait()
        try:
            create_tables(engine)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001  # collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tables = set(inspect(engines[0]).get_table_names())
    for engine in engines:
        engine.dispose()
    assert errors == []
    assert tables == set(SQLModel.metadata.tables)
