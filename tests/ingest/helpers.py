"""Helpers of the ingest tests: drive a join until a condition holds."""

from __future__ import annotations

import time
from collections.abc import Callable

from ingest.join import Join


def run_until(join: Join, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"join did not get there: {join.stats}"
        join.step()
