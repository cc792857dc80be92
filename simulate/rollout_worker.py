"""A rollout worker of the bootstrap's fleet: jobs in from Kafka, groups out, policy by deltas.

`flywheel rollout-worker` runs one on any host that reaches the broker and the artifact store;
`flywheel bootstrap` starts its own as processes. A worker

1. builds its model from the policy store: the model's config and tokenizer (`model/`) and the
   newest full snapshot, then follows the `policy` topic with the `ReleaseSubscriber` serving
   replicas use for releases (same plan, verify, swap in place; a tampered delta is refused),
   which prepares each new version while a batch is made on the one before;
2. takes `RolloutJob`s as a member of one consumer group (jobs are spread over the group's
   members by partition; a member that dies has its partitions, and its uncommitted jobs,
   handed to the others after the group rebalances);
3. per batch of up to `groups_in_flight` jobs: drops the obsolete ones (their step already
   trained), catches up to the newest policy version (waiting for `min_version` if needed),
   makes every group in one decode batch with that one version, produces the `RolloutGroup`s
   to `rollouts` (keyed by job id, acknowledged), and only then commits the jobs.

A worker killed anywhere in 3 loses nothing: the jobs are remade by whoever owns their
partition next, and the trainer drops the second copy of a group by job id.

    worker = FleetWorker.start(kafka, store, WorkerOptions(worker_id="w0"))
    stats = worker.run(stop)   # until stop is set (or `preempt()`: simulate/scavenge.py)
    worker.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ingest.config import KafkaConfig
from ingest.events import encode
from ingest.log import EventConsumer, EventProducer
from ingest.rollout_events import RolloutGroup, RolloutJob
from kernels.delta import apply_delta
from kernels.delta.store import ArtifactStore
from kernels.weights import served_dtype
from serving.config import DEFAULT_PREFIX_CACHE_TOKENS
from serving.engine import ModelVersion
from serving.release_subscriber import ReleaseSubscriber
from serving.torch_engine import TorchEngine
from simulate.agents import AgentProgram
from simulate.harness import Harness, HarnessConfig
from simulate.rollouts import SandboxCache, rollout_group
from simulate.sandbox_service import sandbox_runner
from simulate.tasks import Task

log = logging.getLogger(__name__)

MODEL_PREFIX = "model/"  # the policy model's config and tokenizer files in the policy store
# makes one job's group on the worker's engine: the built-in harness in this process
# (`FleetWorker.harness_group`), or an agent program over the OpenAI API (app/rollouts/)
GroupMaker = Callable[[RolloutJob], Awaitable[RolloutGroup]]


class WorkerOptions(BaseModel):
    """One rollout worker's knobs (the jobs carry everything about the episodes)."""

    worker_id: str = Field(min_length=1, max_length=128)
    group_id: str | None = None  # None: "<rollout-jobs topic>-workers"
    groups_in_flight: int = Field(default=4, ge=1)  # jobs per decode batch
    torch_threads: int = Field(default=1, ge=1)
    prefix_cache_tokens: int = Field(default=DEFAULT_PREFIX_CACHE_TOKENS, ge=0)
    batch_invariant: bool = False
    seed: int = 0
    start_timeout_s: float = Field(default=3600.0, gt=0)  # for the first policy snapshot
    # a Celery broker (redis://…) whose sandbox fleet runs the tool calls and scoring
    # (simulate/sandbox_service.py); None: the local sandbox
    sandbox_url: str | None = None
    # the agent program whose episodes the groups are (simulate/agents.py; run by
    # `python -m app.rollouts.worker`); None: the built-in harness, in this process
    agent: AgentProgram | None = None


class WorkerLaunch(BaseModel):
    """Everything a worker process needs, as one JSON argument
    (`python -m simulate.rollout_worker`)."""

    kafka: KafkaConfig
    store_url: str
    options: WorkerOptions


@dataclass
class WorkerStats:
    jobs: int = 0  # groups made and delivered
    obsolete: int = 0  # jobs dropped unmade: their step had already trained
    samples: int = 0
    busy_s: float = 0.0  # making groups
    wait_s: float = 0.0  # waiting for a policy version
    preempted: int = 0  # jobs given back unmade (a scavenging replica's users came back)


def host_worker_id() -> str:
    """A worker id unique to this process: `<hostname>-<pid>`."""
    import os
    import socket

    return f"{socket.gethostname()}-{os.getpid()}"


def wait_for_snapshot(store: ArtifactStore, *, timeout_s: float,
                      stop: threading.Event | None = None) -> bool:
    """Until the store holds a full policy snapshot (a worker may start before the bootstrap
    has published); False when `timeout_s` passed or `stop` was set first."""
    deadline = time.monotonic() + timeout_s
    stop = stop or threading.Event()
    while not any(r.kind == "snapshot" for r in store.releases()):
        if time.monotonic() > deadline or stop.wait(0.5):
            return False
    return True


def load_policy(store: ArtifactStore, workdir: Path, *, batch_invariant: bool = False
                ) -> tuple[Any, Any, ModelVersion]:
    """The policy model, its tokenizer and version, from the store's model files and its
    newest snapshot (the caller then follows the deltas announced after it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    for key in store.list(MODEL_PREFIX):
        path = workdir / key[len(MODEL_PREFIX):]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(store.get_bytes(key))
    newest = max((r for r in store.releases() if r.kind == "snapshot"),
                 key=lambda r: r.version)
    config = AutoConfig.from_pretrained(workdir)
    model = AutoModelForCausalLM.from_config(config, dtype=served_dtype(config))
    state = model.state_dict()
    reached = apply_delta(state, store.read_manifest(newest.version, "snapshot"),
                          store.shard_reader(newest.version, "snapshot"))  # verified
    if batch_invariant:
        from kernels.batch_invariant import enable_batch_invariant

        enable_batch_invariant(model)
    return model, AutoTokenizer.from_pretrained(workdir), ModelVersion(reached.version,
                                                                        reached.sha256)


class FleetWorker:
    """One worker: its own engine on the newest policy version, and (once `join`ed) a member
    of the workers' consumer group. `run` until stopped or preempted; `leave` hands the
    uncommitted jobs back to the group; `close` ends it all. `make_group` makes each job's
    group (default: `harness_group`)."""

    def __init__(self, engine: TorchEngine, kafka: KafkaConfig, store: ArtifactStore,
                 options: WorkerOptions, cache: SandboxCache | None = None, *,
                 join: bool = True) -> None:
        self.engine, self.kafka, self.options = engine, kafka, options
        self.cache = cache or SandboxCache(sandbox_runner(options.sandbox_url))
        self.make_group: GroupMaker = self.harness_group
        self.stats = WorkerStats()
        self.policy = ReleaseSubscriber(engine, kafka, store, topic=kafka.topics.policy,
                                        auto_swap=False, prepare_ahead=True,
                                        poll_timeout_ms=50).start()
        self.producer = EventProducer(kafka, client_id=options.worker_id)
        self._jobs: EventConsumer | None = None
        if join:
            self.join()

    def join(self, *, instance_id: str | None = None) -> None:
        """Become a member of the workers' group (a share of the jobs topic's partitions).
        With `instance_id` (Kafka's static membership) `leave` sends no LeaveGroup: the
        member's partitions move when its session expires, as when a worker dies."""
        jobs = self.kafka.topics.rollout_jobs
        static = {"group_instance_id": instance_id} if instance_id else {}
        self._jobs = EventConsumer(
            self.kafka, group_id=self.options.group_id or f"{jobs}-workers",
            types={jobs: RolloutJob}, dlq=self.producer, name=self.options.worker_id,
            max_poll_records=self.options.groups_in_flight, fetch_max_wait_ms=50,
            # the trainer spreads a step's jobs over consecutive partitions
            # (trainer/bootstrap/fleet.py): dealt out in turn, they split evenly; by range,
            # one of two members would hold partitions 0-2 of 6 and make 3 of a step's 4 jobs
            # while the other made 1
            assignment="roundrobin", **static)

    def leave(self) -> None:
        """Leave the group: the jobs taken but not committed go to the other members."""
        if self._jobs is not None:
            self._jobs.close()
            self._jobs = None

    @classmethod
    def start(cls, kafka: KafkaConfig, store: ArtifactStore, options: WorkerOptions, *,
              join: bool = True, own_process: bool = True) -> FleetWorker:
        """Load the policy and start following it. `own_process`: the worker owns this
        process and sets its torch threads and seed (False inside a serving replica)."""
        import torch

        # the model code before the wait: a worker started early is ready when the snapshot is
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

        if own_process:
            torch.set_num_threads(options.torch_threads)
            torch.manual_seed(options.seed)
        if not wait_for_snapshot(store, timeout_s=options.start_timeout_s):
            raise TimeoutError(f"no policy snapshot in {store.config} after "
                               f"{options.start_timeout_s:.0f}s: is the bootstrap running?")
        with tempfile.TemporaryDirectory(prefix="flywheel-policy-") as tmp:
            model, tokenizer, version = load_policy(store, Path(tmp),
                                                    batch_invariant=options.batch_invariant)
        engine = TorchEngine(model, tokenizer, seed=options.seed, max_batch=128,
                             prefix_cache_tokens=options.prefix_cache_tokens)
        engine.set_version(version)
        log.info("%s: policy v%d loaded", options.worker_id, version.number)
        return cls(engine, kafka, store, options, join=join)

    def run(self, stop: threading.Event, preempt: Callable[[], bool] | None = None
            ) -> WorkerStats:
        """Take jobs until `stop` is set or `preempt()` says so; a preempted batch is dropped
        uncommitted (the caller `leave`s, and its jobs go to the other members)."""
        assert self._jobs is not None, "join() first"
        while not stop.is_set() and not (preempt and preempt()):
            jobs = [d.event for d in self._jobs.poll(timeout_ms=100)]
            if jobs:
                self._make(jobs, stop, preempt)
            else:
                self._catch_up()  # idle: stay on the newest version anyway
        return self.stats

    def _catch_up(self, *, retry: bool = False) -> None:
        record = self.policy.catch_up(retry=retry)
        if record is not None:
            log.info("%s: on v%d sha256 %s (%d step(s), %.0f ms paused)", self.options.worker_id,
                     record.version, record.live_sha256, record.steps, record.paused_s * 1e3)

    def _make(self, jobs: list[RolloutJob], stop: threading.Event,
              preempt: Callable[[], bool] | None) -> None:
        self._catch_up()
        newest = self.policy.newest_version
        live = [j for j in jobs if newest is None or newest <= j.step]
        self.stats.obsolete += len(jobs) - len(live)
        if live:
            if not self._wait_for(max(j.min_version for j in live), stop):
                return  # stopping: nothing committed, the jobs go to the next owner
            log.info("%s: making %s on v%d", self.options.worker_id,
                     ",".join(j.job_id for j in live), self.engine.version.number)
            start = time.monotonic()
            groups = asyncio.run(self._groups(live, preempt))
            self.stats.busy_s += time.monotonic() - start
            if groups is None:  # preempted: nothing delivered, nothing committed
                self.stats.preempted += len(live)
                log.info("%s: preempted, handed back %s", self.options.worker_id,
                         ",".join(j.job_id for j in live))
                return
            log.info("%s: made in %.2fs", self.options.worker_id, time.monotonic() - start)
            self.producer.deliver(self.kafka.topics.rollouts,
                                   [(g.group_id, encode(g)) for g in groups],
                                   timeout_s=self.kafka.delivery_timeout_ms / 1000)
            self.stats.jobs += len(groups)
            self.stats.samples += sum(len(g.trajectories) for g in groups)
        assert self._jobs is not None
        self._jobs.commit()

    def _wait_for(self, version: int, stop: threading.Event) -> bool:
        """Until the engine holds `version` or newer; a swap that failed (a release pruned
        from the store under a slow reader, say) is tried again every half second."""
        start = time.monotonic()
        retry_at = start + 0.5
        while self.engine.version.number < version:
            if stop.wait(0.02):
                return False
            retry = time.monotonic() > retry_at
            retry_at += 0.5 if retry else 0.0
            self._catch_up(retry=retry)
        self.stats.wait_s += time.monotonic() - start
        return True

    async def harness_group(self, job: RolloutJob) -> RolloutGroup:
        """`job`'s group made by the built-in harness on this worker's engine."""
        harness = Harness.on_engine(self.engine, HarnessConfig.of(job.sampling))
        return await rollout_group(harness, Task.model_validate(job.task),
                                   group_size=job.group_size, cache=self.cache, seed=job.seed,
                                   rewards=job.rewards)

    async def _groups(self, jobs: list[RolloutJob], preempt: Callable[[], bool] | None
                      ) -> list[RolloutGroup] | None:
        """The jobs' groups, made at once; None when `preempt()` turned true first (every
        sequence in flight is cancelled: the engine drops them before its next step)."""
        async def one(job: RolloutJob) -> RolloutGroup:
            group = await self.make_group(job)
            return group.model_copy(update={"group_id": job.job_id, "job_id": job.job_id,
                                            "worker": self.options.worker_id})
        batch = asyncio.gather(*(one(j) for j in jobs))
        while preempt is not None and not batch.done():
            await asyncio.wait([batch], timeout=0.005)
            if not batch.done() and preempt():
                batch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await batch
                return None
        return list(await batch)

    def close(self) -> None:
        self.leave()
        self.policy.stop()
        self.producer.close()
        self.engine.close()


class LocalWorkers:
    """`count` workers as processes of this host (`python -m <module>`: this one, or
    `app.rollouts.worker` for an agent program's), from the `template` options (ids
    `<worker_id>-<i>`, seeds `seed + i`), each logging to `log_dir/<id>.log`: the worker
    `flywheel rollout-worker` runs, started for you."""

    def __init__(self, count: int, kafka: KafkaConfig, store_url: str, template: WorkerOptions,
                 log_dir: Path, *, module: str = "simulate.rollout_worker") -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        for i in range(count):
            options = template.model_copy(update={"worker_id": f"{template.worker_id}-{i}",
                                                  "seed": template.seed + i})
            launch = WorkerLaunch(kafka=kafka, store_url=store_url, options=options)
            self.logs.append(log_dir / f"{options.worker_id}.log")
            with self.logs[-1].open("ab") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", module, launch.model_dump_json()],
                    stdout=out, stderr=subprocess.STDOUT))

    def check(self) -> None:
        """Raise when every worker has exited (one lost worker's jobs go to the others)."""
        if self.procs and all(p.poll() is not None for p in self.procs):
            tail = self.logs[-1].read_text(errors="replace")[-2000:]
            raise RuntimeError(f"every rollout worker exited (the last with "
                               f"{self.procs[-1].returncode}):\n{tail}")

    def stop(self, timeout_s: float = 30.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # a worker that will not stop is killed
                proc.kill()
                proc.wait()


def run_worker(launch: WorkerLaunch, stop: threading.Event,
               groups: Callable[[FleetWorker], contextlib.AbstractContextManager[GroupMaker]]
               | None = None) -> WorkerStats:
    """Run one worker until `stop`; `groups` opens the worker's group maker for the run (an
    agent program's, app/rollouts/worker.py), default the built-in harness."""
    from kernels.delta.store import artifact_store_config, build_artifact_store

    if launch.options.agent is not None and groups is None:
        raise ValueError("an agent program's worker runs as `python -m app.rollouts.worker` "
                         "(`flywheel rollout-worker --agent`)")
    store = build_artifact_store(artifact_store_config(launch.store_url))
    worker = FleetWorker.start(launch.kafka, store, launch.options)
    try:
        with (groups(worker) if groups is not None
              else contextlib.nullcontext(worker.harness_group)) as make_group:
            worker.make_group = make_group
            print(f"READY {launch.options.worker_id} v{worker.engine.version.number}",
                  flush=True)
            stats = worker.run(stop)
    finally:
        worker.close()
    log.info("%s: %d groups, %d obsolete jobs dropped, busy %.1fs, waited %.1fs for weights",
             launch.options.worker_id, stats.jobs, stats.obsolete, stats.busy_s, stats.wait_s)
    return stats


def main(argv: list[str]) -> int:
    """`python -m simulate.rollout_worker '<WorkerLaunch JSON>'`: how `flywheel bootstrap`
    starts its workers (`flywheel rollout-worker` builds the same launch from the settings)."""
    import signal

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run_worker(WorkerLaunch.model_validate_json(argv[0]), stop)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
