"""The join's SQLite write path with SQLite's automatic WAL checkpoint against the join's own.

    .venv/bin/python bench/join_wal.py [--batches 300] [--rows 1000] [--rounds 3]

Writes what the join writes per poll for `--rows` matched feedback events (their feedback
rows, their outbox batch; then, as after the produce, the watermark) through
`ingest.join_state.writing`, and prunes the outbox every 20 batches as the sweep does, in
alternating rounds on a fresh file each: `automatic` is SQLite's default (a checkpoint inside
the COMMIT that takes the log past 1,000 pages, while the writer lock is held); `join` is the
join's (no automatic checkpoint; `writing` runs a PASSIVE one after releasing the lock, at most
every `_WriterLock.CHECKPOINT_EVERY_S`). Prints per-row microseconds of the whole loop, of the
writer lock held (the transactions, with any automatic checkpoint) and of the join's own
checkpoints (after the lock), the largest WAL file seen, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import event  # noqa: E402

from ingest import join_state  # noqa: E402
from ingest.join_state import (  # noqa: E402
    MATCHED,
    FeedbackRow,
    JoinFeedback,
    add_to_outbox,
    insert_new,
    mark_produced,
    open_state,
    outbox_row,
    prune_outbox,
    writing,
)

FEEDBACK = ('{"event_id":"%s","generation_id":"gen-%s","kind":"accept","value":null,'
            '"time":"2026-11-23T10:00:00Z","source":"bench"}')


def _automatic_checkpoints(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.cursor().execute("PRAGMA wal_autocheckpoint=1000")  # SQLite's default


def run(mode: str, batches: int, rows: int) -> dict[str, float]:
    path = Path(tempfile.mkdtemp(prefix="bench-join-wal-")) / "join.db"
    engine = open_state(f"sqlite:///{path}")
    every = join_state._WriterLock.CHECKPOINT_EVERY_S
    if mode == "automatic":
        event.listen(engine, "connect", _automatic_checkpoints)
        engine.dispose()  # reconnect with the listener
        join_state._WriterLock.CHECKPOINT_EVERY_S = math.inf
    seq, held, checkpoints, wal_max = 0, 0.0, 0.0, 0
    wal = path.with_name("join.db-wal")
    checkpoint = join_state.checkpoint

    def timed_checkpoint(engine_: Any) -> tuple[int, int, int]:
        nonlocal checkpoints
        t0 = time.perf_counter()
        try:
            return checkpoint(engine_)
        finally:
            checkpoints += time.perf_counter() - t0

    join_state.checkpoint = timed_checkpoint  # type: ignore[assignment]  # `writing` calls it
    start = time.perf_counter()
    try:
        for b in range(batches):
            ids = [uuid.uuid4().hex for _ in range(rows)]
            feedback = [FeedbackRow(i, f"gen-{i[:8]}", "", 1.0, MATCHED) for i in ids]
            seq += 1
            batch = outbox_row(0, seq, [(FEEDBACK % (i, i[:8])).encode() for i in ids],
                               [1.0] * rows, 2.0)
            t = time.perf_counter()
            with writing(engine) as conn:
                insert_new(conn, JoinFeedback, feedback)
                add_to_outbox(conn, [batch])
            with writing(engine) as conn:
                mark_produced(conn, {0: seq}, {(0, 0): seq})
            if b % 20 == 19:
                with writing(engine) as conn:
                    prune_outbox(conn, {0})
            held += time.perf_counter() - t
            wal_max = max(wal_max, wal.stat().st_size if wal.exists() else 0)
    finally:
        join_state._WriterLock.CHECKPOINT_EVERY_S = every
        join_state.checkpoint = checkpoint  # type: ignore[assignment]
        join_state._WRITERS.clear()
        engine.dispose()
    total = time.perf_counter() - start
    n = batches * rows
    return {"us_per_row": total / n * 1e6,
            "locked_us_per_row": (held - checkpoints) / n * 1e6,
            "checkpoint_us_per_row": checkpoints / n * 1e6, "wal_max_mb": wal_max / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"automatic": [], "join": []}
    for _ in range(args.rounds):
        for mode in results:
            r = run(mode, args.batches, args.rows)
            results[mode].append(r)
            print(f"{mode:9s}: {r['us_per_row']:.2f} µs/row in all, {r['locked_us_per_row']:.2f}"
                  f" holding the lock, {r['checkpoint_us_per_row']:.2f} in checkpoints after"
                  f" it; WAL up to {r['wal_max_mb']:.1f} MB")

    def median(mode: str, key: str) -> float:
        values = sorted(r[key] for r in results[mode])
        return round(values[len(values) // 2], 2)

    out = {"bench": "join_wal", "rows_per_txn": args.rows}
    for mode in results:
        for key in ("us_per_row", "locked_us_per_row", "checkpoint_us_per_row", "wal_max_mb"):
            out[f"{mode}_{key}"] = median(mode, key)
    out["ratio"] = round(out["automatic_us_per_row"] / out["join_us_per_row"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
