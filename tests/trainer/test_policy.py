"""Policy logprobs on the real tiny model agree with what the engine sampled."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import torch

from ingest.rollout_events import RolloutGroup, RolloutTrajectory
from serving.engine import GenerationRequest
from simulate.harness import HarnessConfig
from trainer.policy import (
    MIN_SHARED_PREFIX,
    Policy,
    TokenBatch,
    sequence_logprobs,
    shared_prefix,
)


def test_policy_logprobs_match_engine_behavior_logprobs(model_dir: Path) -> None:
    from serving.torch_engine import TorchEngine

    policy = Policy.load(model_dir, lr=1e-3)
    engine = TorchEngine.load(model_dir, seed=0, threads=1)
    try:
        prompt = engine.tokenizer.encode("def add_3(x):\n", add_special_tokens=False)
        result = asyncio.run(engine.generate(GenerationRequest(
            prompt_token_ids=prompt, max_tokens=12, temperature=0.7, seed=3)))
    finally:
        engine.close()
    tokens = prompt + result.token_ids
    mask = [0] * len(prompt) + [1] * len(result.token_ids)
    batch = policy.batch([tokens, prompt], [mask, [0] * len(prompt)])  # padded second row
    with torch.no_grad():
        logp = policy.token_logprobs(batch, temperature=0.7)
    trained = logp[0, len(prompt):]
    assert torch.allclose(trained, torch.tensor(result.logprobs), atol=1e-3)
    assert batch.loss_mask[1].sum() == 0  # padding never trains


def test_optimizer_step_changes_weights_and_version(model_dir: Path) -> None:
    policy = Policy.load(model_dir, lr=1e-2)
    before = policy.state_dict()
    batch = policy.batch([[5, 6, 7, 8]], [[0, 1, 1, 1]])
    loss = -(policy.token_logprobs(batch) * batch.loss_mask).sum()
    loss.backward()
    policy.optimizer_step()
    after = policy.state_dict()
    assert policy.version == 1
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_rollouts_on_a_caching_engine_have_the_policys_logprobs(model_dir: Path) -> None:
    """Groups of multi-turn episodes made together (prefix-cache hits, batched prefills, rows
    joining and leaving the batch) carry behavior logprobs the trainer's forward reproduces."""
    from simulate.rollouts import SandboxCache, rollout_group, unpack_segments
    from simulate.tasks import BuiltinTaskSource
    from trainer.bootstrap.config import BootstrapSettings
    from trainer.bootstrap.local_engine import build_harness, make_engine

    policy = Policy.load(model_dir, lr=1e-3)
    cfg = BootstrapSettings(max_turns=3, max_tokens=24)
    engine = make_engine(policy, cfg, seed=0)
    try:
        harness = build_harness(engine, cfg, temperature=1.0)
        tasks = BuiltinTaskSource(0.2).split("train")[:3]

        async def groups() -> list:  # type: ignore[type-arg]
            return list(await asyncio.gather(*(
                rollout_group(harness, task, group_size=4, cache=SandboxCache(), seed=i)
                for i, task in enumerate(tasks))))

        made = asyncio.run(groups())
        assert engine.prefix_cache is not None and engine.prefix_cache.hits > 0
    finally:
        engine.close()
    segments = [s for g in made for t in g.trajectories for s in unpack_segments(t)]
    turns = [sum(a < b for a, b in zip([0.0, *s.loss_mask[:-1]], s.loss_mask, strict=True))
             for s in segments]
    assert max(turns) > 1  # model turns after observations, in one context
    batch = policy.batch([s.token_ids for s in segments], [s.loss_mask for s in segments])
    with torch.no_grad():
        logp = policy.token_logprobs(batch, temperature=1.0)
    behavior = batch.pad_like([s.logprobs for s in segments])
    assert ((logp - behavior).abs() * batch.loss_mask).max() < 1e-3


def _logprobs_and_grads(policy: Policy, batch: TokenBatch, *, share_prefix: bool,
                        routes: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    policy.model.zero_grad()
    logp = sequence_logprobs(policy.model, batch, share_prefix=share_prefix, routes=routes)
    (logp * batch.loss_mask).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in policy.model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize(("batch_invariant", "replay"),
                         [(False, False), (True, False), (True, True)])
def test_a_shared_prefix_computed_once_gives_the_logprobs_and_gradients_of_whole_rows(
        model_dir: Path, batch_invariant: bool, replay: bool) -> None:
    """Rows opening with the same system prompt: the prefix goes through the layers once, and
    the logprobs and the gradient (which flows back through its key/value cache) are those of
    one forward over whole rows; bit for bit under the batch-invariant kernels, and with MoE
    routes replayed (experts no router chose: the prefix's the same in every row)."""
    from kernels.moe_replay import NO_ROUTE, find_routers

    policy = Policy.load(model_dir, lr=1e-3, batch_invariant=batch_invariant)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(5, 2000, (MIN_SHARED_PREFIX + 20,), generator=generator).tolist()
    rows = [prefix + torch.randint(5, 2000, (n,), generator=generator).tolist()
            for n in (9, 23, 40)]
    trained_from = len(prefix) + 3  # the prefix and a little more are prompt
    batch = policy.batch(rows, [[0] * trained_from + [1] * (len(r) - trained_from) for r in rows])
    routes = None
    if replay:
        config = policy.model.config
        shape = (len(rows), batch.tokens.shape[1], len(find_routers(policy.model)),
                 config.num_experts_per_tok)
        routes = torch.randint(0, config.num_experts, shape, generator=generator,
                               dtype=torch.int16)
        routes[:, :len(prefix)] = routes[:1, :len(prefix)]
        routes[batch.attention_mask == 0] = NO_ROUTE
        routes[:, :, :, 1] = (routes[:, :, :, 0] + 1) % config.num_experts  # k distinct experts
    assert shared_prefix(batch, limit=trained_from - 1, routes=routes) == len(prefix)

    shared, shared_grads = _logprobs_and_grads(policy, batch, share_prefix=True, routes=routes)
    whole, whole_grads = _logprobs_and_grads(policy, batch, share_prefix=False, routes=routes)
    assert shared_grads.keys() == whole_grads.keys() and whole_grads
    if batch_invariant:
        assert torch.equal(shared, whole)
    else:
        torch.testing.assert_close(shared, whole, rtol=0, atol=1e-5)
    for name, grad in whole_grads.items():  # float sums in another order: close in norm
        error = float((shared_grads[name] - grad).norm())
        assert error <= 1e-4 * float(grad.norm()) + 1e-7, (name, error, float(grad.norm()))


def _group_on_policy(policy: Policy, harness: HarnessConfig, *, group_size: int, seed: int,
                     batch_invariant: bool = False) -> RolloutGroup:
    """A group of episodes of the first train task, sampled by an engine on the policy's
    weights."""
    from serving.torch_engine import TorchEngine
    from simulate.harness import Harness
    from simulate.rollouts import SandboxCache, rollout_group
    from simulate.tasks import BuiltinTaskSource

    engine = TorchEngine(policy.unsharded_model().eval(), policy.tokenizer, seed=0,
                         batch_invariant=batch_invariant)
    try:
        task = BuiltinTaskSource(0.2).split("train")[0]
        return asyncio.run(rollout_group(Harness.on_engine(engine, harness), task,
                                         group_size=group_size, cache=SandboxCache(),
                                         seed=seed))
    finally:
        engine.close()


def test_the_bootstrap_learner_replays_the_experts_the_engine_routed(model_dir: Path) -> None:
    """Router replay in the bootstrap's GRPO learner, batch-invariant mode: multi-turn
    episodes carry their tokens' experts, and the learner's forward (through its shared
    prefix) computes the engine's logprobs exactly: max |dlogprob| 0. Routes changed on the
    way reach its logprobs, so they are what it computes with."""
    import numpy as np

    from ingest.events import PackedArray
    from trainer.bootstrap.config import BootstrapSettings
    from trainer.bootstrap.run import OfflineTrainer

    policy = Policy.load(model_dir, lr=1e-3, batch_invariant=True)
    cfg = BootstrapSettings(max_turns=2, max_tokens=12)
    group = _group_on_policy(policy, cfg.harness(temperature=1.0), group_size=3, seed=0,
                             batch_invariant=True)
    # the tiny random model solves nothing: rewards set apart so that the group has a signal
    trajectories = [t.model_copy(update={"reward": float(i)})
                    for i, t in enumerate(group.trajectories)]
    group = group.model_copy(update={"trajectories": trajectories})
    assert all(t.routed_experts is not None for t in group.trajectories)
    learner = OfflineTrainer.from_settings(copy.deepcopy(policy), cfg)
    replayed = learner.step([group])
    assert replayed["max_abs_logprob_diff"] == 0.0

    experts = policy.model.config.num_experts

    def moved(traj: RolloutTrajectory) -> RolloutTrajectory:  # every expert index + 1
        routes = traj.routed_experts.unpack()  # type: ignore[union-attr]
        shifted = np.where(routes >= 0, (routes + 1) % experts, routes)
        return traj.model_copy(update={"routed_experts": PackedArray.pack(shifted, "int16")})

    other = group.model_copy(update={"trajectories": [moved(t) for t in trajectories]})
    changed = OfflineTrainer.from_settings(copy.deepcopy(policy), cfg).step([other])
    assert changed["max_abs_logprob_diff"] > 0.0


def test_a_summarized_episode_trains_its_summary_with_the_episodes_advantage(
        model_dir: Path) -> None:
    """Self-summarization is trained end to end: an episode whose context was summarized is
    one row per context window, each with the episode's advantage; the summary the model
    wrote (the first window's last turn) is in its loss mask, and one learner step raises its
    probability in the episode the group favours and lowers it in the one it does not."""
    from trainer.bootstrap.config import BootstrapSettings
    from trainer.bootstrap.run import OfflineTrainer

    policy = Policy.load(model_dir, lr=1e-3)
    # a budget so small that the context is summarized after the first turn
    harness = HarnessConfig(max_turns=3, max_tokens=10, context_budget=40, max_summaries=1)
    group = _group_on_policy(policy, harness, group_size=2, seed=2)
    trajectories = [t.model_copy(update={"reward": float(r)})
                    for t, r in zip(group.trajectories, (1.0, 0.0), strict=True)]
    group = group.model_copy(update={"trajectories": trajectories})
    windows = [len(t.segment_lengths) for t in trajectories]
    assert windows == [2, 2]  # both summarized once

    rows, _ = OfflineTrainer.rows([group])
    assert len(rows) == 4 and rows.advantages[0] == rows.advantages[1] > 0 > rows.advantages[2]
    assert rows.advantages[2] == rows.advantages[3]

    def summary_logprob(row: int) -> float:
        """Mean logprob of the first window's last trained run: the summary."""
        mask = rows.masks[row]
        end = max(i for i, m in enumerate(mask) if m) + 1
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        batch = policy.batch([rows.sequences[row]], [[0] * start + [1] * (end - start)])
        with torch.no_grad():
            logp = sequence_logprobs(policy.model, batch)
        return float(logp[0, start:end].mean())

    assert "Summarize your progress" in policy.tokenizer.decode(rows.sequences[0])
    before = [summary_logprob(0), summary_logprob(2)]
    OfflineTrainer.from_settings(policy, BootstrapSettings()).step([group])
    after = [summary_logprob(0), summary_logprob(2)]
    assert after[0] > before[0] and after[1] < before[1]
