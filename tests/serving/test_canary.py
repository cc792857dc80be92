"""Which engine serves a session while a canary runs (serving/canary.py), on the tiny model."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path

from serving.canary import ServedVersions, canary_bucket
from serving.engine import GenerationRequest
from serving.torch_engine import TorchEngine


def test_a_session_has_one_bucket_and_the_share_splits_sessions() -> None:
    sessions = [uuid.uuid4().hex for _ in range(4000)]
    buckets = [canary_bucket(s) for s in sessions]
    assert buckets == [canary_bucket(s) for s in sessions]  # sticky: the id decides
    assert all(0.0 <= b < 1.0 for b in buckets)
    assert abs(sum(b < 0.2 for b in buckets) / len(buckets) - 0.2) < 0.03


def test_the_canary_engine_closes_once_its_last_request_is_done(model_dir: Path) -> None:
    primary = TorchEngine.load(model_dir, threads=1)
    canary = TorchEngine.load(model_dir, version_number=0, threads=1)
    versions = ServedVersions(primary)
    try:
        assert versions.engine_for("anything") is primary
        versions.open_canary(canary, 0.5)
        inside = next(s for s in (uuid.uuid4().hex for _ in range(100))
                      if canary_bucket(s) < 0.5)
        outside = next(s for s in (uuid.uuid4().hex for _ in range(100))
                       if canary_bucket(s) >= 0.5)
        assert versions.engine_for(inside) is canary
        assert versions.engine_for(outside) is primary
        assert versions.engine_for(None) is primary  # no session: the served release
        done: list[int] = []

        def request() -> None:  # a request in flight on the canary while it is closed
            with versions.serving(canary, inside):
                result = asyncio.run(canary.generate(GenerationRequest(
                    prompt_token_ids=[1, 2, 3], max_tokens=16, seed=0)))
                done.append(len(result.token_ids))

        thread = threading.Thread(target=request)
        thread.start()
        deadline = time.monotonic() + 30
        while not versions.in_flight(canary) and time.monotonic() < deadline:
            time.sleep(0.001)
        closed = versions.close_canary()
        thread.join(timeout=60)
        assert closed is canary and done and done[0] >= 1  # it finished, then the close
        assert versions.canary is None and versions.engine_for(inside) is primary
    finally:
        primary.close()
        canary.close()


def test_a_request_planned_on_a_canary_closed_since_runs_on_the_primary(
        model_dir: Path) -> None:
    """The engine is chosen when a request is planned and counted when it runs: a canary
    closed in between (its drain saw nothing in flight) does not take the request down; it
    runs where its session is served now."""
    primary = TorchEngine.load(model_dir, threads=1)
    canary = TorchEngine.load(model_dir, version_number=0, threads=1)
    versions = ServedVersions(primary)
    try:
        versions.open_canary(canary, 1.0)
        planned = versions.engine_for("a-session")
        assert planned is canary
        assert versions.close_canary() is canary  # nothing in flight: closed at once
        with versions.serving(planned, "a-session") as engine:
            assert engine is primary and versions.in_flight(primary) == 1
            result = asyncio.run(engine.generate(GenerationRequest(
                prompt_token_ids=[1, 2, 3], max_tokens=4, seed=0)))
        assert result.token_ids and versions.in_flight(primary) == 0
    finally:
        primary.close()
        canary.close()
