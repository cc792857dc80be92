"""The bootstrap's side of the rollout fleet: jobs out, groups in (policy versions go out
through `trainer/bootstrap/policy_publisher.py`).

- `RolloutFleet` issues `RolloutJob`s and admits the `RolloutGroup`s that come back.
  Bounded staleness is admission control at the source: the jobs of step k (min_version
  k - max_staleness) are issued only once that version has been announced, so every job in
  flight can be made at once, and no group is made that could only be discarded. Jobs go
  out from the publisher's thread the moment a version is announced (the trainer may be in
  the middle of a step then), and again whenever the trainer waits for groups. A group is
  admitted once per job (a second copy, from a worker that died before committing its job
  and the member that remade it, is dropped by job id); one older than its job allows is
  discarded with the reason and its slot issued again as a new job. The ledger says how
  every job ended.

    with open_local_fleet(cfg, kafka=None, work_dir=run_dir) as local:  # broker, workers
        ...  # mid-training: the workers start meanwhile, then wait for the first snapshot
        publisher = PolicyPublisher(store, local.kafka).start(version, weights, model_files)
        fleet = RolloutFleet(local.kafka, cfg, sampler, publisher, first_step=version)
        groups = fleet.take_step(step)     # issues jobs as versions are announced; blocks
        publisher.publish(version + 1, new_weights)
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingest.broker import open_broker
from ingest.config import KafkaConfig
from ingest.events import encode
from ingest.log import EventProducer, ensure_topics
from ingest.rollout_events import RolloutGroup, RolloutJob, RolloutSampling
from ingest.topic_reader import TopicReader
from simulate.rollout_worker import LocalWorkers
from trainer.bootstrap.config import BootstrapSettings
from trainer.bootstrap.policy_publisher import FleetError, PolicyPublisher
from trainer.bootstrap.task_sampler import TaskSampler

log = logging.getLogger(__name__)


@dataclass
class LocalFleet:
    """A run's side of the fleet that needs no policy yet: the broker, the policy store's URL
    and the worker processes of this host."""

    kafka: KafkaConfig
    work_dir: Path
    store_url: str
    workers: LocalWorkers


@contextlib.contextmanager
def open_local_fleet(cfg: BootstrapSettings, *, kafka: KafkaConfig | None,
                     work_dir: Path | None, batch_invariant: bool = False,
                     worker_module: str = "simulate.rollout_worker") -> Iterator[LocalFleet]:
    """Over `kafka` (None: an embedded broker, for the run), start `cfg.rollout_workers`
    worker processes (`python -m <worker_module>`: an agent program's workers are
    `app.rollouts.worker`, which the command line names), which wait for the run's first
    policy snapshot in the store (`cfg.policy_store_url`, or `work_dir`/policy, removed at
    the end). Opened before mid-training, the workers' start (interpreter, torch, model code)
    overlaps it."""
    with contextlib.ExitStack() as stack:
        if kafka is None:
            kafka = KafkaConfig(bootstrap=stack.enter_context(open_broker(None)))
        ensure_topics(kafka)
        if work_dir is None:
            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="grpo-")))
        work_dir.mkdir(parents=True, exist_ok=True)
        store_url = cfg.policy_store_url or str(work_dir / "policy")
        if cfg.policy_store_url is None:  # the run's own, for its workers only
            stack.callback(shutil.rmtree, work_dir / "policy", ignore_errors=True)
        workers = LocalWorkers(cfg.rollout_workers, kafka, store_url,
                               cfg.worker_options("worker", batch_invariant=batch_invariant),
                               work_dir, module=worker_module)
        stack.callback(workers.stop)
        yield LocalFleet(kafka, work_dir, store_url, workers)


@dataclass
class Ledger:
    """How each issued job ended: admitted once, or discarded with a reason."""

    issued: dict[str, RolloutJob] = field(default_factory=dict)
    admitted: dict[str, str] = field(default_factory=dict)  # job id -> worker
    discarded: dict[str, str] = field(default_factory=dict)  # job id -> reason
    duplicates: int = 0  # second copies of an admitted or discarded job's group, dropped
    foreign: int = 0  # groups of jobs this run never issued (another run's), ignored
    # an agent program's episodes dropped and made again, by reason (admitted groups')
    dropped_episodes: Counter[str] = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        workers: dict[str, int] = defaultdict(int)
        for worker in self.admitted.values():
            workers[worker] += 1
        return {"issued": len(self.issued), "admitted": len(self.admitted),
                "discarded": len(self.discarded), "duplicates": self.duplicates,
                "foreign": self.foreign, "by_worker": dict(workers),
                "agent_episodes_dropped": dict(self.dropped_episodes)}


class RolloutFleet:
    def __init__(self, kafka: KafkaConfig, cfg: BootstrapSettings, tasks: TaskSampler,
                 publisher: PolicyPublisher, *, first_step: int, steps: int,
                 run_id: str | None = None,
                 stall_timeout_s: float = 300.0,
                 health: Callable[[], None] | None = None) -> None:
        self.kafka, self.cfg, self.tasks, self.publisher = kafka, cfg, tasks, publisher
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.first_step = first_step
        self.end_slot = (first_step + steps) * cfg.groups_per_step  # no job past the last step
        self.stall_timeout_s = stall_timeout_s
        self.health = health  # raises when the workers are gone (LocalWorkers.check)
        self.ledger = Ledger()
        self.idle_s = 0.0  # the trainer's wait in take_step
        # jobs go out from the trainer's thread and the publisher's (`_on_announced`)
        self._lock = threading.Lock()
        self._closed = False
        self._rng = random.Random(cfg.seed)
        self._next_slot = first_step * cfg.groups_per_step
        self._reissues = 0
        self._step_of: dict[str, tuple[int, int]] = {}  # job id -> (step, slot)
        self._ready: dict[int, list[tuple[int, RolloutGroup]]] = defaultdict(list)
        self._producer = EventProducer(kafka, client_id=f"fleet-{self.run_id}")
        self._partitions = self._producer.partitions(kafka.topics.rollout_jobs)
        # this run's groups come after this point (resolved now, before any job goes out)
        self._groups = TopicReader(kafka, kafka.topics.rollouts, RolloutGroup, start="end",
                                   dlq=self._producer, name="bootstrap",
                                   fetch_max_wait_ms=50, max_poll_records=64)
        publisher.on_announced.append(self._on_announced)

    def min_version(self, step: int) -> int:
        return max(self.first_step, step - self.cfg.staleness)

    def take_step(self, step: int) -> list[RolloutGroup]:
        """Every group of `step`, in slot order; issues jobs while it waits."""
        start = last_progress = time.monotonic()
        have = len(self._ready[step])
        while len(self._ready[step]) < self.cfg.groups_per_step:
            self._issue()
            self._poll()
            if self.health is not None:
                self.health()
            if len(self._ready[step]) > have:
                have, last_progress = len(self._ready[step]), time.monotonic()
            elif time.monotonic() - last_progress > self.stall_timeout_s:
                raise FleetError(f"no group of step {step} arrived for "
                                 f"{self.stall_timeout_s:.0f}s: are rollout workers running?")
        self.idle_s += time.monotonic() - start
        return [g for _, g in sorted(self._ready.pop(step), key=lambda x: x[0])]

    def close(self, jobs_path: Path | None = None) -> dict[str, Any]:
        """Stop; every job not admitted by now is discarded ("run ended"). Returns the
        ledger's summary; writes each job's end to `jobs_path` (JSON lines)."""
        self.publisher.on_announced.remove(self._on_announced)
        with self._lock:
            self._closed = True
        ledger = self.ledger
        for job_id in ledger.issued:
            if job_id not in ledger.admitted and job_id not in ledger.discarded:
                ledger.discarded[job_id] = "run ended"
        self._groups.close()
        self._producer.close()
        if jobs_path is not None:
            with jobs_path.open("w") as f:
                for job_id, job in ledger.issued.items():
                    f.write(json.dumps({
                        "job_id": job_id, "step": job.step, "task_id": job.task["task_id"],
                        "min_version": job.min_version,
                        "admitted_from": ledger.admitted.get(job_id),
                        "discarded": ledger.discarded.get(job_id)}) + "\n")
        return ledger.summary()

    # ---- jobs out --------------------------------------------------------------------------
    def _on_announced(self, version: int) -> None:
        """On the publisher's thread: the jobs `version` lets start go out now rather than
        when the trainer next waits for groups, which it may not do for a whole step. A failure
        here is only logged: the trainer's own `_issue` tries again and raises."""
        try:
            self._issue()
        except Exception:
            log.warning("jobs for v%d not issued on announcing it; the trainer will", version,
                        exc_info=True)

    def _issue(self) -> None:
        """Issue every slot whose step may start on the announced version."""
        gps = self.cfg.groups_per_step
        sent = False
        with self._lock:
            while (not self._closed and self._next_slot < self.end_slot
                   and self._next_slot // gps - self.cfg.staleness <= self.publisher.announced):
                slot = self._next_slot
                self._next_slot += 1
                self._send(slot // gps, slot, f"{self.run_id}-{slot}")
                sent = True
        if sent:
            self._producer.flush(self.kafka.delivery_timeout_ms / 1000)

    def _send(self, step: int, slot: int, job_id: str) -> None:
        cfg = self.cfg
        task = self.tasks.draw(self._rng, 1)[0]
        job = RolloutJob(job_id=job_id, run_id=self.run_id, step=step,
                         min_version=self.min_version(step), group_size=cfg.group_size,
                         seed=slot, task=task.model_dump(mode="json"),
                         sampling=RolloutSampling(temperature=cfg.temperature,
                                                  max_tokens=cfg.max_tokens,
                                                  max_turns=cfg.max_turns,
                                                  context_budget=cfg.context_budget,
                                                  max_summaries=cfg.max_summaries,
                                                  overflow=cfg.context_overflow),
                         rewards=cfg.rewards)
        self.ledger.issued[job_id] = job
        self._step_of[job_id] = (step, slot)
        # slots round-robin over the partitions, which the workers' group deals out in turn
        # (simulate/rollout_worker.py): consecutive jobs go to different workers
        self._producer.send_raw(self.kafka.topics.rollout_jobs, job_id, encode(job),
                                partition=slot % self._partitions)

    # ---- groups in -------------------------------------------------------------------------
    def _poll(self) -> None:
        for record in self._groups.poll(timeout_ms=50):
            with self._lock:
                self._admit(record.event)

    def _admit(self, group: RolloutGroup) -> None:
        ledger, job_id = self.ledger, group.job_id or ""
        if job_id not in ledger.issued:
            ledger.foreign += 1
            return
        if job_id in ledger.admitted or job_id in ledger.discarded:
            ledger.duplicates += 1
            return
        step, slot = self._step_of[job_id]
        if group.policy_version < ledger.issued[job_id].min_version:
            ledger.discarded[job_id] = (f"made by v{group.policy_version}, the job needs "
                                        f"v{ledger.issued[job_id].min_version} or newer")
            self._reissues += 1
            self._send(step, slot, f"{self.run_id}-{slot}-r{self._reissues}")
            return
        ledger.admitted[job_id] = group.worker or "?"
        ledger.dropped_episodes.update(group.dropped)
        self.tasks.observe([group])
        self._ready[step].append((slot, group))
