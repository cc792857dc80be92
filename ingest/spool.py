"""A local append-only spool of Kafka records, for when the broker cannot be reached.

Records are appended as JSON lines and fsynced; `read` returns the oldest unreplayed ones with
the byte offset after them; `commit(offset)` marks them replayed (a sidecar `.offset` file,
replaced atomically). Once everything is replayed the file is truncated. A torn last line (a
crash mid-append) is dropped on open. Replay is at-least-once: a crash between a replay and
its commit sends those records again; consumers dedupe by key.

    spool = Spool(Path("data/spool/sessions.jsonl"))
    spool.append([SpoolRecord("sessions", "gen-1", b"{...}")])
    records, end = spool.read(100); ...send them...; spool.commit(end)
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SpoolRecord:
    topic: str
    key: str
    value: bytes

    def line(self) -> bytes:
        return json.dumps({"topic": self.topic, "key": self.key,
                           "value": self.value.decode("utf-8")}).encode("utf-8") + b"\n"

    @classmethod
    def parse(cls, line: bytes) -> SpoolRecord:
        obj = json.loads(line)
        return cls(topic=obj["topic"], key=obj["key"], value=obj["value"].encode("utf-8"))


class Spool:
    """Thread-safe; one writer process per path (the data dir belongs to one server)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset_path = path.with_name(path.name + ".offset")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._drop_torn_tail()
        self._file = open(path, "ab")  # noqa: SIM115  (held for the spool's life)
        self._committed = self._read_offset()
        self._pending = self._count_lines(self._committed)

    def _drop_torn_tail(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(keep)

    def _read_offset(self) -> int:
        try:
            offset = int(self._offset_path.read_text().strip() or 0)
        except FileNotFoundError:
            return 0
        return min(offset, self.path.stat().st_size)

    def _count_lines(self, start: int) -> int:
        with open(self.path, "rb") as f:
            f.seek(start)
            return sum(1 for _ in f)

    @property
    def pending_records(self) -> int:
        return self._pending

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._file.tell() - self._committed

    def append(self, records: Sequence[SpoolRecord]) -> None:
        """Append and fsync: once this returns the records survive a crash."""
        if not records:
            return
        data = b"".join(r.line() for r in records)
        with self._lock:
            self._file.write(data)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._pending += len(records)

    def read(self, max_records: int) -> tuple[list[SpoolRecord], int]:
        """The oldest unreplayed records (at most `max_records`) and the offset after them."""
        with self._lock:
            start, size = self._committed, self._file.tell()
        records: list[SpoolRecord] = []
        with open(self.path, "rb") as f:
            f.seek(start)
            end = start
            while len(records) < max_records and end < size:
                line = f.readline()
                if not line.endswith(b"\n"):
                    break
                records.append(SpoolRecord.parse(line))
                end += len(line)
        return records, end

    def commit(self, end: int) -> None:
        """Mark everything before byte `end` replayed; truncate once nothing is left."""
        with self._lock:
            replayed = self._count_between(self._committed, end)
            self._pending -= replayed
            if end >= self._file.tell():
                self._file.truncate(0)
                self._file.seek(0)
                self._committed = 0
            else:
                self._committed = end
            tmp = self._offset_path.with_name(self._offset_path.name + ".tmp")
            tmp.write_text(str(self._committed))
            os.replace(tmp, self._offset_path)

    def _count_between(self, start: int, end: int) -> int:
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(end - start).count(b"\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()
