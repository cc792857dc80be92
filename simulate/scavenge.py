"""Off-peak scavenging: a serving replica makes rollouts for the bootstrap while its users are
away, and gives the cores back the moment they return.

The `Scavenger` runs a rollout worker (`simulate.rollout_worker.FleetWorker`) on a thread of the
replica's process, with its own engine and its own copy of the policy weights (built from the
policy store and following the `policy` topic): never the served release. It

1. waits until the replica is quiet: no user request in flight for `quiet_s`, and fewer than
   `max_rps` arrivals per second over the last `window_s`;
2. joins the rollout workers' consumer group and takes jobs like any worker;
3. the moment a user request is in flight, preempts: cancels every rollout sequence of the
   batch (the engine drops them before its next decode step), delivers nothing, commits
   nothing, and leaves the group, so its jobs go to the other workers after the rebalance;
4. goes back to 1.

It leaves as a worker that died does: it joins with a fresh static-membership id each time
and sends no LeaveGroup, so its partitions move when its session expires (6 s embedded, 45 s
on Kafka by default). On the embedded Tansu broker a LeaveGroup that arrives while another
member's join is in flight leaves that member waiting for an assignment indefinitely
(measured: 40 s and counting), which would stall the whole bootstrap.

    scavenger = Scavenger(live, WorkerLaunch(kafka=..., store_url=..., options=...),
                          ScavengeSettings(enabled=True, store_url=...)).start()
    scavenger.status(); scavenger.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from serving.live_load import LiveLoad

if TYPE_CHECKING:
    from simulate.rollout_worker import FleetWorker, WorkerLaunch

log = logging.getLogger(__name__)


class ScavengeSettings(BaseModel):
    """A serving replica's off-peak rollouts (FLYWHEEL_SCAVENGE__*)."""

    enabled: bool = False
    # the bootstrap's broker and policy store (None: the replica's own broker; the store
    # must be given when enabled)
    kafka_bootstrap: str | None = None
    store_url: str | None = None
    max_rps: float = Field(default=0.5, ge=0, description="join only below this user rate")
    window_s: float = Field(default=10.0, gt=0, description="over which the rate is taken")
    quiet_s: float = Field(default=2.0, ge=0,
                           description="and only after this long with no request in flight")
    groups_in_flight: int = Field(default=2, ge=1)


class Scavenger:
    def __init__(self, live: LiveLoad, launch: WorkerLaunch, settings: ScavengeSettings) -> None:
        self.live = live
        self.launch = launch
        self.settings = settings
        self.joins = 0
        self.preemptions = 0
        self.error: str | None = None
        self._worker: FleetWorker | None = None
        self._member = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scavenger", daemon=True)

    def start(self) -> Scavenger:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def status(self) -> dict[str, Any]:
        worker = self._worker
        stats = worker.stats if worker is not None else None
        return {"worker_id": self.launch.options.worker_id, "member": self._member,
                "joins": self.joins, "preemptions": self.preemptions,
                "groups": stats.jobs if stats else 0, "samples": stats.samples if stats else 0,
                "jobs_handed_back": stats.preempted if stats else 0,
                "policy_version": worker.engine.version.number if worker else None,
                "error": self.error}

    def quiet(self) -> bool:
        return (self.live.quiet_for() >= self.settings.quiet_s
                and self.live.rate() < self.settings.max_rps)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.quiet():
                    self._stop.wait(0.05)
                    continue
                worker = self._worker or self._start_worker()
                if worker is None or not self.quiet():  # users came while the copy loaded
                    continue
                worker.join(instance_id=f"{self.launch.options.worker_id}-{self.joins}")
                self._member, self.joins = True, self.joins + 1
                log.info("%s: replica quiet, scavenging", self.launch.options.worker_id)
                worker.run(self._stop, preempt=self.live.busy)
                worker.leave()
                self._member = False
                if not self._stop.is_set():
                    self.preemptions += 1
                    log.info("%s: users back, jobs handed back", self.launch.options.worker_id)
        except Exception as exc:  # the thread's only report; serving goes on without it
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("scavenger stopped")
        finally:
            if self._worker is not None:
                self._worker.close()

    def _start_worker(self) -> FleetWorker | None:
        """Load the second copy of the weights (waiting for the bootstrap's first snapshot
        without blocking `stop`)."""
        from kernels.delta.store import artifact_store_config, build_artifact_store
        from simulate.rollout_worker import FleetWorker, wait_for_snapshot

        store = build_artifact_store(artifact_store_config(self.launch.store_url))
        if not wait_for_snapshot(store, timeout_s=float("inf"), stop=self._stop):
            return None
        started = time.monotonic()
        self._worker = FleetWorker.start(self.launch.kafka, store, self.launch.options,
                                         join=False, own_process=False)
        log.info("%s: own policy copy v%d loaded in %.1fs", self.launch.options.worker_id,
                 self._worker.engine.version.number, time.monotonic() - started)
        return self._worker
