"""The join's SQLite state: WAL checkpoints run after the writer lock, not inside commits."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest.join_state import (
    JoinSession,
    SessionRow,
    _WriterLock,
    checkpoint,
    insert_new,
    open_state,
    writing,
)


def _write_sessions(engine: object, start: int, count: int) -> None:
    with writing(engine) as conn:  # type: ignore[arg-type]
        insert_new(conn, JoinSession, [SessionRow(f"g{i}", "x" * 4000, 0.0, False)
                                       for i in range(start, start + count)])


def test_commits_leave_checkpoints_to_writing(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite's automatic checkpoint (at 1,000 log pages, inside the COMMIT, under the
    writer lock) is off: commits grow the log past it; `writing` checkpoints it once due."""
    engine = open_state(f"sqlite:///{tmp_path / 'join.db'}")
    monkeypatch.setattr(_WriterLock, "CHECKPOINT_EVERY_S", 3600.0)
    _write_sessions(engine, 0, 10)  # (a process's first write is followed by one)
    for start in range(10, 2010, 200):  # ~2,000 pages in 10 commits, none due
        _write_sessions(engine, start, 200)
    wal = tmp_path / "join.db-wal"
    assert wal.stat().st_size > 1800 * 4096  # ~2,000 pages: no automatic checkpoint reset it

    monkeypatch.setattr(_WriterLock, "CHECKPOINT_EVERY_S", 0.0)
    _write_sessions(engine, 2010, 1)  # due now: the whole log checkpointed after the commit
    monkeypatch.setattr(_WriterLock, "CHECKPOINT_EVERY_S", 3600.0)
    _write_sessions(engine, 2011, 1)  # so this write starts the log again from its head
    busy, log, done = checkpoint(engine)
    assert busy == 0 and log < 10, (log, done)  # else it would still hold ~2,000 frames
    engine.dispose()
