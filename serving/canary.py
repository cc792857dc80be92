"""Two versions on one replica: the served release for most sessions, and a canary release
for a share of them, chosen by session id.

A release announced with `canary_share` (trainer/release/pipeline.py) is served beside its
parent: the replica's follower (serving/release_subscriber.py) builds a second engine, takes
it from the base model to the canary's version through the artifact store (the same verified
chain a fresh replica walks), and `ServedVersions` hands it every session whose bucket falls
under the share. The bucket is a hash of the session id, so every turn of a session, on any
replica, is served by one version, and the arms are the same on every replica. A request
without a session id is the served release's. When the canary is promoted, the primary
engine hot-swaps to it in place (the release's own delta: the usual pause) and then the
canary engine is drained and closed; when it is rolled back, the canary engine is drained
and closed and the primary never moved.

Memory: the canary's engine holds a second copy of the weights and its own prefix cache
while the canary lasts (the default model: 9 MB of fp32 weights). A replica that cannot
afford it runs without a canary engine (`ReleaseSubscriber(canary_engine=None)`) and serves
every session the served release; a fleet then canaries on the replicas that can, behind a
load balancer that keeps a session on one replica (docs/releases.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from serving.engine import Engine


def canary_bucket(session_id: str) -> float:
    """Where a session falls in [0, 1): the first 8 bytes of its id's sha256. The canary
    serves the sessions under its share."""
    digest = hashlib.sha256(session_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


@dataclass(frozen=True)
class Canary:
    engine: Engine
    share: float


class ServedVersions:
    """Which engine serves a session, and how many requests each engine has in flight (so a
    canary engine is closed only once its last request is done)."""

    def __init__(self, primary: Engine) -> None:
        self.primary = primary
        self._canary: Canary | None = None
        self._in_flight: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def canary(self) -> Canary | None:
        return self._canary

    def engine_for(self, session_id: str | None) -> Engine:
        """The canary's engine for sessions in its share, else the primary."""
        canary = self._canary
        if canary is not None and session_id is not None and (
                canary_bucket(session_id) < canary.share):
            return canary.engine
        return self.primary

    @contextlib.contextmanager
    def serving(self, engine: Engine, session_id: str | None) -> Iterator[Engine]:
        """Count a request in flight while the block runs, on `engine` (the one `engine_for`
        chose when it was planned), or, when that was a canary closed since, on the engine
        that serves `session_id` now. The choice and the count share the lock `close_canary`
        takes, so a canary engine is never closed under a request."""
        with self._lock:
            canary = self._canary
            if engine is not self.primary and (canary is None or engine is not canary.engine):
                engine = self.engine_for(session_id)
            self._in_flight[id(engine)] = self._in_flight.get(id(engine), 0) + 1
        try:
            yield engine
        finally:
            with self._lock:
                self._in_flight[id(engine)] -= 1

    def in_flight(self, engine: Engine) -> int:
        with self._lock:
            return self._in_flight.get(id(engine), 0)

    def open_canary(self, engine: Engine, share: float) -> None:
        """Serve the sessions under `share` from `engine` from now on."""
        with self._lock:
            self._canary = Canary(engine, share)

    def close_canary(self, drain_timeout_s: float = 120.0) -> Engine | None:
        """Send every new session to the primary, wait for the canary engine's requests in
        flight to finish (up to `drain_timeout_s`), then close it; returns it (None: none)."""
        with self._lock:
            canary, self._canary = self._canary, None
        if canary is None:
            return None
        deadline = time.monotonic() + drain_timeout_s
        while self.in_flight(canary.engine) and time.monotonic() < deadline:
            time.sleep(0.01)
        canary.engine.close()
        with self._lock:
            self._in_flight.pop(id(canary.engine), None)
        return canary.engine

    def status(self) -> dict[str, Any] | None:
        """The canary served here: its version and share (None: none)."""
        canary = self._canary
        if canary is None:
            return None
        version = canary.engine.version
        return {"version": version.number, "sha256": version.sha256, "share": canary.share,
                "in_flight": self.in_flight(canary.engine)}
