"""Which replica serves which version: every API process says so in the `replica` table
(`app.db.ReplicaSeen`) every `BEAT_S`, and the console lists those heard from within
`LIVE_S`. Processes that share the database see each other: PostgreSQL across hosts, the
SQLite file on one host. A replica that stops cleanly removes its row at once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session, col, select

from app.db import ReplicaSeen
from ingest.events import utcnow

log = logging.getLogger(__name__)
BEAT_S = 5.0  # how often a replica says what it serves
LIVE_S = 30.0  # a replica not heard from for this long is left out


def replica_id(port: int) -> str:
    return f"{socket.gethostname()}:{port} (pid {os.getpid()})"


class ReplicaBeacon:
    """A thread writing this replica's served version (`version()`: an object with `number`
    and `sha256`) to the `replica` table every `BEAT_S`; `close` removes the row."""

    def __init__(self, db: Engine, replica: str, version: Callable[[], Any]) -> None:
        self.db, self.replica, self.version = db, replica, version
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-beacon", daemon=True)

    def start(self) -> ReplicaBeacon:
        self._thread.start()
        return self

    def beat(self) -> None:
        served = self.version()
        with Session(self.db) as session:
            row = session.get(ReplicaSeen, self.replica) or ReplicaSeen(
                replica_id=self.replica, version=served.number, sha256=served.sha256)
            row.version, row.sha256, row.seen_at = served.number, served.sha256, utcnow()
            session.add(row)
            session.commit()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except SQLAlchemyError as exc:  # the database is away: say it next time
                log.warning("replica beacon: %s", exc)
            self._stop.wait(BEAT_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=BEAT_S + 30)
        try:
            with Session(self.db) as session:
                row = session.get(ReplicaSeen, self.replica)
                if row is not None:
                    session.delete(row)
                    session.commit()
        except SQLAlchemyError as exc:
            log.warning("replica beacon: could not remove %s: %s", self.replica, exc)


def live_replicas(session: Session) -> list[ReplicaSeen]:
    """The replicas heard from within `LIVE_S`, by id."""
    since = utcnow() - timedelta(seconds=LIVE_S)
    return list(session.exec(select(ReplicaSeen).where(col(ReplicaSeen.seen_at) >= since)
                             .order_by(col(ReplicaSeen.replica_id))).all())
