"""The figures the operator console (`/console`) needs that no other admin route gives.

`ConsoleFeeds` is held by `Services` and started on first use: a `RewardTally` following
`experiences` (live acceptance and mean reward per served version), an `OffsetProbe` (the
join's lag per partition and what the join has produced for the trainer, both read by a thread
of its own, so that neither a `/metrics` scrape nor the console's route waits on the broker or
fails when it is slow), and the delta size of each
release, read once from its manifest in the artifact store. `snapshot` puts them
together with the session-log spool and the webhook refusals from the app's metrics.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict
from typing import Any

from pydantic import BaseModel

from app.api.metrics import REJECTION_REASONS, Metrics
from app.api.replicas import replica_id
from app.settings import Settings
from ingest.config import KafkaConfig
from ingest.offsets import OffsetProbe, PartitionLag
from ingest.reward_tally import RewardTally

log = logging.getLogger(__name__)
LAG_EVERY_S = 5.0  # how often the join's lag is read


class ConsoleSnapshot(BaseModel):
    """`GET /admin/console`: what the console shows beside the releases and the trainer."""

    replica: dict[str, Any]  # this API process: id, served version and sha256
    replicas: list[dict[str, Any]]  # every replica heard from lately (app/api/replicas.py)
    acceptance: list[dict[str, Any]]  # per served version: totals and points over time
    join_lag: list[dict[str, Any]]  # per partition of sessions and feedback
    experiences_produced: int  # what the join wrote to `experiences`; the trainer consumes it
    spool: dict[str, int]  # the session log's local spool awaiting replay
    webhook_rejections: dict[str, int]  # by reason
    private: dict[str, int]  # this replica's generations: all, and those in privacy mode
    delta_bytes: dict[str, int | None]  # per release version: bytes a replica fetches


class ConsoleFeeds:
    """Started on first use; `close` stops the tally thread and the Kafka clients."""

    def __init__(self, settings: Settings, kafka: KafkaConfig) -> None:
        self.settings, self.kafka = settings, kafka
        self._lock = threading.RLock()  # kafka-python's clients take one caller at a time
        self._tally: RewardTally | None = None
        self._probe: OffsetProbe | None = None
        self._delta_bytes: dict[int, int | None] = {}
        self._lag: list[PartitionLag] = []
        self._produced = 0  # records on `experiences`, as last read
        self._lag_read = threading.Event()  # set once the lag was read
        self._lag_thread: threading.Thread | None = None
        self._starting = threading.Lock()
        self._stop = threading.Event()

    def tally(self) -> RewardTally:
        with self._lock:
            if self._tally is None:
                self._tally = RewardTally(self.kafka).start()
            return self._tally

    def probe(self) -> OffsetProbe:
        with self._lock:
            if self._probe is None:
                self._probe = OffsetProbe(self.kafka)
            return self._probe

    def join_lag(self, *, wait: bool = True) -> list[PartitionLag]:
        """The join's lag per partition as last read; a thread reads it every `LAG_EVERY_S`
        (started on first use). `wait`: until the first reading, at most a request timeout
        (the console's route); a scrape of `/metrics` takes what there is."""
        with self._starting:  # not self._lock, which the thread holds while it asks
            if self._lag_thread is None:
                self._lag_thread = threading.Thread(target=self._follow_log, name="join-lag",
                                                    daemon=True)
                self._lag_thread.start()
        if wait:
            self._lag_read.wait(timeout=self.kafka.request_timeout_ms / 1000)
        return self._lag

    def experiences_produced(self) -> int:
        """Records the join has written to `experiences`, as last read with the lag."""
        return self._produced

    def _follow_log(self) -> None:
        from ingest.log import BrokerError

        topics = [self.kafka.topics.sessions, self.kafka.topics.feedback]
        while not self._stop.is_set():
            try:
                with self._lock:
                    self._lag = self.probe().group_lag(self.settings.join.group_id, topics)
                    self._produced = sum(
                        self.probe().end_offsets(self.kafka.topics.experiences).values())
                self._lag_read.set()
            except (BrokerError, OSError) as exc:  # the broker is away: keep the last reading
                log.warning("join lag unavailable: %s", exc)
            self._stop.wait(LAG_EVERY_S)

    def delta_bytes(self, releases: list[tuple[int, str | None]]) -> dict[str, int | None]:
        """Bytes of each release's delta from its manifest (None: the base, or unreadable)."""
        from kernels.delta.store import artifact_store_config, build_artifact_store

        store = None
        for version, manifest_uri in releases:
            if version in self._delta_bytes or manifest_uri is None:
                continue
            store = store or build_artifact_store(
                artifact_store_config(self.settings.resolved_artifact_store_url))
            try:
                self._delta_bytes[version] = store.read_manifest(version).nbytes
            except (OSError, KeyError, ValueError) as exc:
                log.warning("release v%d: no manifest to size (%s)", version, exc)
                self._delta_bytes[version] = None
        return {str(v): self._delta_bytes.get(v) for v, _ in releases}

    def close(self) -> None:
        self._stop.set()
        if self._lag_thread is not None:
            self._lag_thread.join(timeout=self.kafka.request_timeout_ms / 1000 + 5)
        with self._lock:
            if self._tally is not None:
                self._tally.close()
            if self._probe is not None:
                self._probe.close()


def snapshot(feeds: ConsoleFeeds, metrics: Metrics, engine_version: Any,
             session_log: Any, releases: list[tuple[int, str | None]],
             replicas: list[dict[str, Any]]) -> ConsoleSnapshot:
    stats = session_log.stats() if session_log is not None else None
    return ConsoleSnapshot(
        replica={"id": replica_id(feeds.settings.port), "version": engine_version.number,
                 "sha256": engine_version.sha256},
        replicas=replicas,
        acceptance=feeds.tally().snapshot(),
        join_lag=[asdict(p) for p in feeds.join_lag()],
        experiences_produced=feeds.experiences_produced(),
        spool={"records": stats.spool_records if stats else 0,
               "bytes": stats.spool_bytes if stats else 0},
        webhook_rejections={r: int(metrics.counted(metrics.feedback_rejected, {"reason": r}))
                            for r in REJECTION_REASONS},
        private={"generations": int(metrics.counted(metrics.generations)),
                 "private": int(metrics.counted(metrics.private_generations))},
        delta_bytes=feeds.delta_bytes(releases))
