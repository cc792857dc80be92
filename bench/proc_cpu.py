"""CPU seconds read from Linux /proc, for the benches that split a machine's CPU by where it
went (bench/feedback.py, bench/agent_rollouts.py)."""

from __future__ import annotations

import os
from pathlib import Path


def _cpu_seconds(stat: Path, *, reaped: bool) -> float:
    fields = stat.read_text().rpartition(")")[2].split()
    return sum(int(v) for v in fields[11:15 if reaped else 13]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds(pid: int, *, reaped: bool = False) -> float:
    """User + system CPU seconds of process `pid` alone (all its threads); with `reaped`, also
    those of the children it has waited for."""
    return _cpu_seconds(Path(f"/proc/{pid}/stat"), reaped=reaped)


def thread_cpu_seconds(tid: int) -> float:
    """User + system CPU seconds of one thread of this process, by its native id (/proc/TID
    itself reads as the whole process)."""
    return _cpu_seconds(Path(f"/proc/self/task/{tid}/stat"), reaped=False)


def children(pid: int) -> list[int]:
    """The live children of `pid` (of each of its threads; a thread that ends meanwhile has
    none)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return out


def cpu_seconds(pid: int, *, reaped: bool = False) -> float:
    """User + system CPU seconds of `pid` and its live descendants (`reaped`: as in
    `own_cpu_seconds`, for each of them)."""
    total, pending = 0.0, [pid]
    while pending:
        p = pending.pop()
        try:
            total += own_cpu_seconds(p, reaped=reaped)
            pending += children(p)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total
