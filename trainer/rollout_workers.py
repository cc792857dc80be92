"""Rollout workers: make the groups the `StalenessGate` asks for, on an engine of their own.

A `RolloutWorker` (a thread of the trainer's process) claims slots, waits until the weights are
fresh enough, and hands the work to its `Rollouts`:

- `LocalRollouts`: an engine, a harness and a sandbox cache in this process. The engine's
  decode loop and the trainer share one interpreter lock.
- `ProcessRollouts`: the same `LocalRollouts` in a spawned child process, so rollouts and the
  trainer run on separate cores without contending for that lock. The wire is a pipe carrying
  work orders and finished `RolloutGroup`s; new weights travel as safetensors bytes, only when
  the version changed (9 MB for the default model).

    rollouts = build_rollouts(policy, cfg, seed=0, cache=cache)   # cfg.rollout_isolation
    groups = rollouts.make(version, state, tasks, seeds=[0, 1])    # blocks; version-tagged
    rollouts.close()
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import random
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
from safetensors.torch import load, save

from ingest.events import RolloutGroup
from kernels.batch_invariant import (
    disable_batch_invariant,
    enable_batch_invariant,
    is_batch_invariant,
)
from kernels.weights import state_dict_sha256
from serving.engine import ModelVersion
from serving.torch_engine import TorchEngine
from simulate.harness import Harness, Segment
from simulate.rollouts import SandboxCache, rollout_group
from simulate.tasks import Task
from trainer.bootstrap_config import BootstrapSettings
from trainer.pipeline import PipelineClosedError, StalenessGate
from trainer.policy import Policy
from trainer.task_sampler import TaskSampler

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]


class RolloutProcessError(RuntimeError):
    """The rollout child process failed or exited; carries its traceback or exit code."""


def build_harness(engine: TorchEngine, cfg: BootstrapSettings, *,
                  temperature: float) -> Harness[Segment]:
    return Harness.on_engine(engine, cfg.harness(temperature=temperature))


def engine_for(model: Any, tokenizer: Any, cfg: BootstrapSettings, *, seed: int) -> TorchEngine:
    return TorchEngine(model.eval(), tokenizer, seed=seed, max_batch=128,
                       prefix_cache_tokens=cfg.prefix_cache_tokens)


def make_engine(policy: Policy, cfg: BootstrapSettings, *, seed: int) -> TorchEngine:
    """An engine on a copy of the policy's current weights (batch-invariant if it is)."""
    return engine_for(policy.unsharded_model(), policy.tokenizer, cfg, seed=seed)


def load_weights(engine: TorchEngine, version: int, state: Weights) -> None:
    """Hot-swap `state` into a running engine between decode steps (no restart)."""
    engine.call_between_steps(lambda model: model.load_state_dict(state)).result()
    engine.set_version(ModelVersion(version, state_dict_sha256(state)))


class Rollouts(Protocol):
    def make(self, version: int, state: Weights, tasks: list[Task],
             seeds: list[int]) -> list[RolloutGroup]:
        """One group per task, all on weights `version` (`state`), episode seeds from `seeds`."""
        ...

    def close(self) -> None: ...


class LocalRollouts:
    """Groups made in this process: an engine, its harness and a sandbox cache."""

    def __init__(self, engine: TorchEngine, cfg: BootstrapSettings, cache: SandboxCache) -> None:
        self.engine, self.cache, self.group_size = engine, cache, cfg.group_size
        self.harness = build_harness(engine, cfg, temperature=cfg.temperature)

    def make(self, version: int, state: Weights, tasks: list[Task],
             seeds: list[int]) -> list[RolloutGroup]:
        if version != self.engine.version.number:
            load_weights(self.engine, version, state)
        return asyncio.run(self._gather(tasks, seeds))

    async def _gather(self, tasks: list[Task], seeds: list[int]) -> list[RolloutGroup]:
        return list(await asyncio.gather(*(
            rollout_group(self.harness, task, group_size=self.group_size, cache=self.cache,
                          seed=seed) for task, seed in zip(tasks, seeds, strict=True))))

    def close(self) -> None:
        self.engine.close()


@dataclass(frozen=True)
class _ChildSpec:
    """What the child needs to rebuild the engine: no module objects (patched forwards of a
    batch-invariant model do not pickle), only config, weights and the switch."""

    model_config: Any
    weights: bytes  # safetensors
    version: int  # of `weights`
    tokenizer: Any
    cfg: BootstrapSettings
    seed: int
    batch_invariant: bool


@dataclass(frozen=True)
class _Made:
    groups: list[RolloutGroup]
    sandbox_hits: int  # the child's sandbox cache counts since the last reply
    sandbox_runs: int


class ProcessRollouts:
    """`LocalRollouts` in a spawned child process (see the module docstring)."""

    def __init__(self, policy: Policy, cfg: BootstrapSettings, *, seed: int,
                 cache: SandboxCache) -> None:
        model = policy.unsharded_model()
        spec = _ChildSpec(model_config=disable_batch_invariant(model).config,
                          weights=save(policy.state_dict()), version=policy.version,
                          tokenizer=policy.tokenizer, cfg=cfg, seed=seed,
                          batch_invariant=is_batch_invariant(policy.model))
        ctx = multiprocessing.get_context("spawn")  # fork would copy the trainer's threads
        self._conn, child_end = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child_end, spec),
                                 name=f"rollouts-{seed}", daemon=True)
        self._proc.start()
        child_end.close()
        self._cache = cache  # the child's sandbox counts are added to it
        self._sent_version = policy.version

    def make(self, version: int, state: Weights, tasks: list[Task],
             seeds: list[int]) -> list[RolloutGroup]:
        weights = save(state) if version != self._sent_version else None
        try:
            self._conn.send(("make", version, tasks, seeds, weights is not None))
            if weights is not None:
                self._conn.send_bytes(weights)
            self._sent_version = version
            kind, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._proc.join(timeout=5)
            raise RolloutProcessError(f"rollout process exited "
                                      f"(code {self._proc.exitcode})") from exc
        if kind == "error":
            raise RolloutProcessError(f"rollout process failed:\n{payload}")
        made: _Made = payload
        self._cache.count(hits=made.sandbox_hits, misses=made.sandbox_runs)
        return made.groups

    def close(self) -> None:
        try:
            self._conn.send(("stop",))
        except OSError:
            pass  # already gone
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


def _child_main(conn: Connection, spec: _ChildSpec) -> None:
    """The child: build the engine, then make groups per order until told to stop."""
    from transformers import AutoModelForCausalLM

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's: it sends "stop"
    torch.set_num_threads(spec.cfg.torch_threads)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(spec.model_config, dtype=torch.float32)
    state = load(spec.weights)
    model.load_state_dict(state)
    if spec.batch_invariant:
        enable_batch_invariant(model)
    cache = SandboxCache()
    rollouts = LocalRollouts(engine_for(model, spec.tokenizer, spec.cfg, seed=spec.seed),
                             spec.cfg, cache)
    rollouts.engine.set_version(ModelVersion(spec.version, state_dict_sha256(state)))
    try:
        while (order := conn.recv())[0] == "make":
            _, version, tasks, seeds, has_weights = order
            state = load(conn.recv_bytes()) if has_weights else {}
            hits, runs = cache.hits, cache.misses
            try:
                groups = rollouts.make(version, state, tasks, seeds)
            except Exception:  # reported to the parent, which stops the run
                conn.send(("error", traceback.format_exc()))
                return
            conn.send(("made", _Made(groups, cache.hits - hits, cache.misses - runs)))
    except EOFError:
        pass  # the parent went away
    finally:
        rollouts.close()


def build_rollouts(policy: Policy, cfg: BootstrapSettings, *, seed: int,
                   cache: SandboxCache) -> Rollouts:
    if cfg.rollout_isolation == "process":
        return ProcessRollouts(policy, cfg, seed=seed, cache=cache)
    return LocalRollouts(make_engine(policy, cfg, seed=seed), cfg, cache)


class WeightStore:
    """The latest published weights; workers copy them into their engines in place."""

    def __init__(self, version: int, state: Weights) -> None:
        self._lock = threading.Lock()
        self._version, self._state = version, state

    def put(self, version: int, state: Weights) -> None:
        with self._lock:
            self._version, self._state = version, state

    def latest(self) -> tuple[int, Weights]:
        with self._lock:
            return self._version, self._state


@dataclass
class RolloutWorker:
    """Makes the groups the gate asks for, with weights at least as fresh as it requires."""

    rollouts: Rollouts
    gate: StalenessGate[RolloutGroup]
    weights: WeightStore
    tasks: TaskSampler
    seed: int = 0
    groups_in_flight: int = 1  # groups of one step made together: larger decode batches
    busy_s: float = 0.0
    samples: int = 0
    errors: list[str] = field(default_factory=list)

    def run(self) -> None:
        order = random.Random(self.seed)
        try:
            while True:
                slots = self.gate.claim_batch(self.groups_in_flight)
                self.gate.wait_for_weights(slots[-1].step)
                version, state = self.weights.latest()
                tasks = self.tasks.draw(order, len(slots))
                start = time.monotonic()
                groups = self.rollouts.make(version, state, tasks, [s.index for s in slots])
                self.busy_s += time.monotonic() - start
                self.tasks.observe(groups)
                self.samples += sum(len(g.trajectories) for g in groups)
                for slot, group in zip(slots, groups, strict=True):
                    self.gate.submit(slot, group, policy_version=group.policy_version)
        except PipelineClosedError:
            return
        except Exception as exc:  # surfaced by the trainer, which then stops the run
            log.exception("rollout worker failed")
            self.errors.append(repr(exc))
            self.gate.close()
