"""Users' requests as a replica sees them: how many are in flight, how many arrived lately.

The completion route wraps each request in `LiveLoad.request()`; whatever runs beside serving
on the replica's cores (a scavenging rollout worker, simulate/scavenge.py) reads `busy()`,
`rate()` and `quiet_for()` to stay out of the users' way. Thread-safe: the route runs on the
event loop, readers on their own threads.

    live = LiveLoad(window_s=10)
    with live.request(): ...            # the route
    if live.busy(): preempt()           # the scavenger
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager


class LiveLoad:
    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._arrivals: deque[float] = deque()
        self._in_flight = 0
        self._last_seen = float("-inf")  # the last arrival or departure

    @contextmanager
    def request(self) -> Iterator[None]:
        now = time.monotonic()
        with self._lock:
            self._arrivals.append(now)
            self._in_flight += 1
            self._last_seen = now
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                self._last_seen = time.monotonic()

    def busy(self) -> bool:
        """Some user's request is in flight."""
        return self._in_flight > 0

    def rate(self) -> float:
        """Arrivals per second over the last `window_s`."""
        with self._lock:
            horizon = time.monotonic() - self.window_s
            while self._arrivals and self._arrivals[0] < horizon:
                self._arrivals.popleft()
            return len(self._arrivals) / self.window_s

    def quiet_for(self) -> float:
        """Seconds since the last request came or went (0 while one is in flight)."""
        with self._lock:
            return 0.0 if self._in_flight else time.monotonic() - self._last_seen
