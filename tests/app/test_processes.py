"""The entry points' signal handling (app/cli/processes.py), in a process of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# a SIGTERM whose handler runs inside a finalizer: Python drops the exception raised there
FINALIZER_KILL = """
import os, signal, time
from app.cli.processes import interrupt_on_sigterm

interrupt_on_sigterm()

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):  # the handler runs here, inside the finalizer
            pass

Finalized()
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    pass
print("still running", flush=True)
"""


def test_a_sigterm_that_lands_in_a_finalizer_still_stops_the_process() -> None:
    proc = subprocess.run([sys.executable, "-c", FINALIZER_KILL], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert "still running" not in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode != 0 and "Terminated: SIGTERM" in proc.stderr, proc.stderr[-2000:]
