"""An engine in the trainer's own process, on a copy of the policy's weights: for held-out
evaluation (`evaluate`) and the benches' fixed-task measurements (`mean_reward`,
`sample_episodes`); rollouts for training come from the fleet (trainer/bootstrap/fleet.py).

    engine = make_engine(policy, cfg, seed=0)
    outcomes = evaluate(engine, cfg, tasks, cache)   # one greedy episode per task
    load_weights(engine, policy.version, policy.state_dict())   # in place, between steps
"""

from __future__ import annotations

import asyncio

import torch

from ingest.rollout_events import RolloutGroup, RolloutTrajectory
from kernels.weights import state_dict_sha256
from serving.engine import ModelVersion
from serving.torch_engine import TorchEngine
from simulate.harness import Harness, Segment
from simulate.rollouts import SandboxCache, TaskOutcome, rollout_group, run_once
from simulate.tasks import Task
from trainer.bootstrap.config import BootstrapSettings
from trainer.policy import Policy

Weights = dict[str, torch.Tensor]


def build_harness(engine: TorchEngine, cfg: BootstrapSettings, *,
                  temperature: float) -> Harness[Segment]:
    return Harness.on_engine(engine, cfg.harness(temperature=temperature))


def make_engine(policy: Policy, cfg: BootstrapSettings, *, seed: int) -> TorchEngine:
    """An engine on a copy of the policy's current weights (batch-invariant if it is)."""
    return TorchEngine(policy.unsharded_model().eval(), policy.tokenizer, seed=seed,
                       max_batch=128, prefix_cache_tokens=cfg.prefix_cache_tokens)


def load_weights(engine: TorchEngine, version: int, state: Weights) -> None:
    """Hot-swap `state` into a running engine between decode steps (no restart)."""
    engine.call_between_steps(lambda model: model.load_state_dict(state)).result()
    engine.set_version(ModelVersion(version, state_dict_sha256(state)))


def evaluate(engine: TorchEngine, cfg: BootstrapSettings, tasks: list[Task],
             cache: SandboxCache) -> list[TaskOutcome]:
    """One episode per task of the first `eval_tasks` (greedy by default)."""
    harness = build_harness(engine, cfg, temperature=cfg.eval_temperature)
    return asyncio.run(run_once(harness, tasks[:cfg.eval_tasks], cache=cache, seed=cfg.seed))


def sample_episodes(policy: Policy, cfg: BootstrapSettings, tasks: list[Task], *,
                    samples: int, cache: SandboxCache, temperature: float
                    ) -> list[RolloutTrajectory]:
    """`samples` seeded episodes per task of `tasks` at `temperature`, on an engine holding
    a copy of the policy's weights."""
    engine = make_engine(policy, cfg, seed=cfg.seed)
    try:
        harness = build_harness(engine, cfg, temperature=temperature)

        async def groups() -> list[RolloutGroup]:
            return list(await asyncio.gather(*(
                rollout_group(harness, task, group_size=samples, cache=cache, seed=i)
                for i, task in enumerate(tasks))))

        return [t for g in asyncio.run(groups()) for t in g.trajectories]
    finally:
        engine.close()


def mean_reward(policy: Policy, cfg: BootstrapSettings, tasks: list[Task], *, samples: int,
                cache: SandboxCache) -> float:
    """The policy's expected episode reward on `tasks`: `samples` seeded episodes per task at
    the training temperature. Comparing runs on one fixed task list removes the noise of
    which tasks each run's last steps happened to draw."""
    rewards = [t.reward for t in sample_episodes(policy, cfg, tasks, samples=samples,
                                                 cache=cache, temperature=cfg.temperature)]
    return sum(rewards) / max(1, len(rewards))
