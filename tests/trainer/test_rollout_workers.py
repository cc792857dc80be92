"""Rollouts in a child process: the weights it samples with are the trainer's, version by
version, and its failures reach the parent with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ingest.events import RolloutGroup
from simulate.rollouts import SandboxCache, unpack_segments
from simulate.tasks import BuiltinTaskSource
from trainer.bootstrap_config import BootstrapSettings
from trainer.policy import Policy
from trainer.rollout_workers import ProcessRollouts, RolloutProcessError


def max_logprob_gap(policy: Policy, groups: list[RolloutGroup]) -> float:
    segments = [s for g in groups for t in g.trajectories for s in unpack_segments(t)]
    batch = policy.batch([s.token_ids for s in segments], [s.loss_mask for s in segments])
    with torch.no_grad():
        logp = policy.token_logprobs(batch, temperature=1.0)
    behavior = batch.pad_like([s.logprobs for s in segments])
    return float(((logp - behavior).abs() * batch.loss_mask).max())


def test_child_samples_with_each_published_version(model_dir: Path) -> None:
    policy = Policy.load(model_dir, lr=1e-2)
    cfg = BootstrapSettings(max_turns=2, max_tokens=16, group_size=3)
    tasks = BuiltinTaskSource(0.2).split("train")[:2]
    cache = SandboxCache()
    rollouts = ProcessRollouts(policy, cfg, seed=0, cache=cache)
    try:
        first = rollouts.make(policy.version, policy.state_dict(), tasks, seeds=[0, 1])
        assert [g.policy_version for g in first] == [0, 0]
        assert [len(g.trajectories) for g in first] == [3, 3]
        assert max_logprob_gap(policy, first) < 1e-3
        assert cache.hits + cache.misses >= 6  # the child's sandbox runs are counted here

        before = policy.state_dict()
        batch = policy.batch([[1, 2, 3, 4, 5, 6]], [[0, 1, 1, 1, 1, 1]])
        (-(policy.token_logprobs(batch) * batch.loss_mask).sum()).backward()
        policy.optimizer_step()
        assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())
        second = rollouts.make(policy.version, policy.state_dict(), tasks, seeds=[2, 3])
        assert [g.policy_version for g in second] == [1, 1]
        assert max_logprob_gap(policy, second) < 1e-3  # sampled with the new weights
    finally:
        rollouts.close()


def test_child_failure_reaches_the_parent_with_its_traceback(model_dir: Path) -> None:
    policy = Policy.load(model_dir, lr=1e-3)
    tasks = BuiltinTaskSource(0.2).split("train")[:2]
    rollouts = ProcessRollouts(policy, BootstrapSettings(), seed=0, cache=SandboxCache())
    try:
        with pytest.raises(RolloutProcessError, match="ValueError"):  # one seed for two tasks
            rollouts.make(policy.version, policy.state_dict(), tasks, seeds=[0])
        with pytest.raises(RolloutProcessError, match="exited"):  # the child is gone
            rollouts.make(policy.version, policy.state_dict(), tasks, seeds=[0, 1])
    finally:
        rollouts.close()
