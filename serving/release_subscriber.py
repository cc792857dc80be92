"""A serving replica's follower of the `releases` topic.

Each replica reads every release: it assigns itself all partitions and reads from the start
(no consumer group, so no group join and no replica steals another's records), building the
release tree. After each poll the newest announcement (by `published_at`) is the target; the
replica hands it to `Engine.swap_to`, which prepares and verifies it while the engine keeps
serving, then writes it in place between decode steps. A release that fails verification
is refused, logged and recorded, and the replica keeps serving what it had.

A release announced as a canary (`canary_share`) is served beside its parent: with a
`canary_engine` factory the replica builds a second engine for it and `ServedVersions`
(serving/canary.py) routes the canary's share of sessions there, while the primary engine
keeps following the newest release announced for every session. When the canary is promoted
(the same version announced again without a share) the primary hot-swaps to it as to any
release and the canary engine is drained and closed; when it is rolled back (its parent
announced again), the canary engine is drained and closed and the primary never moved.

A rollout worker follows the bootstrap's policy versions with the same class on the `policy`
topic, with `auto_swap=False`: it calls `catch_up()` between batches of groups, so each batch
is made by one version. With `prepare_ahead` (an engine that holds its weights in this
process), the subscriber's thread prepares and verifies the newest announcement while the
batch runs, so `catch_up()` only writes it in.

    subscriber = ReleaseSubscriber(engine, kafka, store)
    subscriber.start(); ...; subscriber.status(); subscriber.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

from ingest.config import KafkaConfig
from ingest.events import ReleasePublished
from ingest.topic_reader import TopicReader
from kernels.delta import DeltaError
from kernels.delta.store import ArtifactNotFoundError, ArtifactStore
from serving.canary import ServedVersions
from serving.engine import Engine, EngineError, ModelVersion, SwapRecord
from serving.hot_swap import InPlaceEngine, PreparedSwap, Weights

log = logging.getLogger(__name__)


class ReleaseSubscriber:
    def __init__(self, engine: Engine, kafka: KafkaConfig, store: ArtifactStore, *,
                 poll_timeout_ms: int = 200, topic: str | None = None,
                 auto_swap: bool = True, prepare_ahead: bool = False,
                 versions: ServedVersions | None = None,
                 canary_engine: Callable[[], Engine] | None = None) -> None:
        self._in_place = engine if isinstance(engine, InPlaceEngine) else None
        if prepare_ahead and self._in_place is None:
            raise ValueError("prepare_ahead needs an engine whose weights live in this process")
        self.engine = engine
        self.kafka = kafka
        self.store = store
        self.poll_timeout_ms = poll_timeout_ms
        self.topic = topic or kafka.topics.releases
        self.auto_swap = auto_swap
        self.prepare_ahead = prepare_ahead
        self._prepared: PreparedSwap | None = None
        self._unprepared: ModelVersion | None = None  # prepare ahead failed: catch_up retries
        self._live: Weights | None = None  # the engine's state dict (prepare_ahead: at start)
        self._swap_lock = threading.Lock()
        self._newest: ReleasePublished | None = None  # any announcement, a canary's too
        self._newest_full: ReleasePublished | None = None  # for every session: the primary's
        self.versions = versions or ServedVersions(engine)
        self.canary_engine = canary_engine  # None: no canary served here
        self._canary_refused: tuple[int, str] | None = None  # (version, published_at)
        self.canary_swaps: list[SwapRecord] = []
        self._handled: tuple[int, str] | None = None  # (version, published_at) last acted on
        self.swaps: list[SwapRecord] = []
        self.refused: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="release-subscriber",
                                        daemon=True)
        self.ready = threading.Event()  # set once the topic has been read to its end

    def start(self) -> ReleaseSubscriber:
        if self._in_place is not None and self.prepare_ahead:  # read once, while it is idle
            self._live = self._in_place.live_weights()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.versions.close_canary()

    @property
    def newest_version(self) -> int | None:
        """The version of the newest announcement for every session (None: none yet)."""
        newest = self._newest_full
        return None if newest is None else newest.version

    @property
    def prepared_version(self) -> int | None:
        """The version prepared ahead, waiting for `catch_up` to write it in (None: none)."""
        prepared = self._prepared
        return None if prepared is None else prepared.version.number

    def catch_up(self, *, retry: bool = False) -> SwapRecord | None:
        """Swap to the newest announcement now, if not done yet (with `auto_swap=False`, the
        owner's call; returns the swap, or None when there was nothing to do or it failed).
        `retry`: try again an announcement whose swap failed."""
        if retry:
            with self._swap_lock:
                self._handled = None
        return self._follow()

    def status(self) -> dict[str, Any]:
        last = self.swaps[-1] if self.swaps else None
        return {"version": self.engine.version.number, "sha256": self.engine.version.sha256,
                "swaps": len(self.swaps), "refused": len(self.refused),
                "last_swap": asdict(last) if last else None,
                "max_pause_s": max((s.paused_s for s in self.swaps), default=0.0),
                "last_refusal": self.refused[-1] if self.refused else None,
                "canary": self.versions.status(),
                "canary_swaps": [asdict(r) for r in self.canary_swaps[-5:]]}

    # ---- subscriber thread ----------------------------------------------------------------
    def _run(self) -> None:
        reader = TopicReader(self.kafka, self.topic, ReleasePublished, fetch_max_wait_ms=100)
        try:
            while not self._stop.is_set():
                for record in reader.poll(timeout_ms=self.poll_timeout_ms):
                    event = record.event
                    if self._newest is None or event.published_at > self._newest.published_at:
                        self._newest = event
                    full = self._newest_full
                    if event.canary_share is None and (
                            full is None or event.published_at > full.published_at):
                        self._newest_full = event
                if not self.ready.is_set() and reader.caught_up():
                    self.ready.set()
                if self.auto_swap:
                    self._follow()
                elif self.prepare_ahead:
                    self._prepare_newest()
        finally:
            reader.close()

    def _prepare_newest(self) -> None:
        """Prepare the newest announcement against the live weights (read only, while the
        owner's batch runs); `catch_up` then commits it. A failure here is left to
        `catch_up`'s swap, which refuses and reports it."""
        target = self._newest_full
        if target is None:
            return
        want = ModelVersion(target.version, target.sha256)
        ready = self._prepared is not None and self._prepared.version == want
        if ready or want in (self.engine.version, self._unprepared):
            return
        assert self._in_place is not None  # checked in __init__
        with self._swap_lock:
            try:
                self._prepared = self._in_place.prepare_swap(self.store, want, live=self._live)
            except (DeltaError, ArtifactNotFoundError, OSError) as exc:
                log.warning("v%d not prepared ahead (catch_up will swap it): %s",
                            want.number, exc)
                self._prepared, self._unprepared = None, want

    def _follow(self) -> SwapRecord | None:
        with self._swap_lock:
            record = self._swap_to_newest()
            self._follow_canary()
            return record

    def _swap_to_newest(self) -> SwapRecord | None:
        target = self._newest_full
        if target is None or self._handled == (target.version, str(target.published_at)):
            return None
        self._handled = (target.version, str(target.published_at))
        if (target.version, target.sha256) == (self.engine.version.number,
                                               self.engine.version.sha256):
            return None
        want = ModelVersion(target.version, target.sha256)
        prepared, self._prepared = self._prepared, None
        try:
            if self._in_place is not None:  # a release prepared ahead, if it still fits
                record = self._in_place.swap_to(self.store, want, prepared=prepared)
            else:
                record = self.engine.swap_to(self.store, want)
        except (DeltaError, ArtifactNotFoundError, EngineError, OSError) as exc:
            log.error("refused release v%d (%s); still serving v%d: %s", target.version,
                      target.kind, self.engine.version.number, exc)
            self.refused.append({"version": target.version, "kind": target.kind,
                                 "error": str(exc), "at": time.time()})
            return None
        self.swaps.append(record)
        if record.live_sha256 != record.sha256:
            log.error("v%d: live weights hash to %s after the swap, expected %s",
                      record.version, record.live_sha256[:12], record.sha256[:12])
        log.info("now on v%d (%d steps, prepared in %.3fs, paused %.1f ms)",
                 record.version, record.steps, record.prepare_s, record.paused_s * 1000)
        return record

    def _follow_canary(self) -> None:
        """Serve the newest announcement beside the primary when it is a canary of the
        version the primary serves; else close the canary engine, if any."""
        newest, served = self._newest, self.versions.canary
        wanted = newest is not None and newest.canary_share is not None and (
            newest.parent == self.engine.version.number) and self.canary_engine is not None
        if not wanted:
            if served is not None:
                closed = self.versions.close_canary()
                log.info("canary v%d closed; every session on v%d",
                         closed.version.number if closed else -1, self.engine.version.number)
            return
        assert newest is not None and newest.canary_share is not None
        assert self.canary_engine is not None
        want = ModelVersion(newest.version, newest.sha256)
        key = (newest.version, str(newest.published_at))
        if served is not None and served.engine.version == want:
            if served.share != newest.canary_share:
                self.versions.open_canary(served.engine, newest.canary_share)
            return
        if self._canary_refused == key:
            return
        if served is not None:
            self.versions.close_canary()
        engine = self.canary_engine()
        try:
            record = engine.swap_to(self.store, want)
        except (DeltaError, ArtifactNotFoundError, EngineError, OSError) as exc:
            engine.close()
            log.error("refused canary v%d; every session stays on v%d: %s", newest.version,
                      self.engine.version.number, exc)
            self._canary_refused = key
            self.refused.append({"version": newest.version, "kind": "canary",
                                 "error": str(exc), "at": time.time()})
            return
        self.versions.open_canary(engine, newest.canary_share)
        self.canary_swaps.append(record)
        log.info("canary v%d served to %.0f%% of sessions beside v%d", newest.version,
                 newest.canary_share * 100, self.engine.version.number)


def follow_releases(versions: ServedVersions, kafka: KafkaConfig, store_url: str, *,
                    poll_timeout_ms: int = 200, registry: Any = None,
                    canary_engine: Callable[[], Engine] | None = None) -> ReleaseSubscriber:
    """Start following `releases` with `versions.primary` (and canaries on engines that
    `canary_engine` builds); with a Prometheus `registry`, export the served version and the
    swap pauses there."""
    from kernels.delta.store import artifact_store_config, build_artifact_store

    store = build_artifact_store(artifact_store_config(store_url))
    subscriber = ReleaseSubscriber(versions.primary, kafka, store,
                                   poll_timeout_ms=poll_timeout_ms, versions=versions,
                                   canary_engine=canary_engine)
    if registry is not None:
        registry.register(_ReplicaCollector(subscriber))
    return subscriber.start()


class _ReplicaCollector:
    """Prometheus view of a subscriber, read at scrape time."""

    def __init__(self, subscriber: ReleaseSubscriber) -> None:
        self.subscriber = subscriber

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.subscriber
        last = s.swaps[-1] if s.swaps else None
        yield GaugeMetricFamily("flywheel_model_version", "Model version being served",
                                value=s.engine.version.number)
        canary = s.versions.status()
        yield GaugeMetricFamily("flywheel_canary_version",
                                "Canary version served beside it (-1: none)",
                                value=canary["version"] if canary else -1)
        yield GaugeMetricFamily("flywheel_canary_share", "Share of sessions on the canary",
                                value=canary["share"] if canary else 0.0)
        yield CounterMetricFamily("flywheel_release_swaps", "Releases swapped in",
                                  value=len(s.swaps))
        yield CounterMetricFamily("flywheel_release_refused", "Releases refused (verification)",
                                  value=len(s.refused))
        yield GaugeMetricFamily("flywheel_release_last_pause_seconds",
                                "Admission pause of the last hot-swap",
                                value=last.paused_s if last else 0.0)
        yield GaugeMetricFamily("flywheel_release_last_copy_seconds",
                                "In-place weight copy of the last hot-swap",
                                value=last.copy_s if last else 0.0)
