"""GRPO math checked against arithmetic written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.grpo import (
    KL_BOUND,
    GRPOLossConfig,
    group_advantages,
    grpo_loss,
    importance_weights,
    kl_k3,
    masked_mean,
)

LOG = math.log


def test_group_advantages_normalize_within_each_group() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735
    # group 1: all equal -> 0 / (0 + eps) = 0
    expected = torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(group_advantages(rewards), expected, atol=1e-5)


def test_group_advantages_without_std_keep_only_the_baseline() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [2.25, -0.75, -0.75, -0.75]])
    assert torch.equal(group_advantages(rewards, scale_by_std=False), expected)


# Two sequences of three tokens. Sequence 0 has advantage +1, sequence 1 has -1 and its last
# token is an observation (mask 0). Ratios exp(logp - old_logp) are chosen directly:
#   seq 0, A=+1: r = 1.5 -> min(1.5, 1.2) = 1.2 (clipped)   loss -1.2
#                r = 0.5 -> min(0.5, 0.8) = 0.5             loss -0.5
#                r = 1.1 -> min(1.1, 1.1) = 1.1             loss -1.1
#   seq 1, A=-1: r = 1.5 -> min(-1.5, -1.2) = -1.5          loss +1.5
#                r = 0.5 -> min(-0.5, -0.8) = -0.8 (clipped) loss +0.8
#                r = 2.0, masked out
RATIOS = [[1.5, 0.5, 1.1], [1.5, 0.5, 2.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADVANTAGES = torch.tensor([1.0, -1.0])


def policy_logp() -> tuple[torch.Tensor, torch.Tensor]:
    old_logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.3, -2.2]])
    logp = (old_logp + torch.tensor(RATIOS).log()).requires_grad_()
    return logp, old_logp


def test_clipped_surrogate_token_aggregation() -> None:
    logp, old_logp = policy_logp()
    loss, metrics = grpo_loss(logp, old_logp, ADVANTAGES, MASK, config=GRPOLossConfig())
    # (-1.2 - 0.5 - 1.1 + 1.5 + 0.8) / 5 tokens
    assert loss.item() == pytest.approx(-0.1, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 1.5 + 0.5) / 5)
    assert metrics["is_weight_mean"] == 1.0 and metrics["kl"] == 0.0


def test_gradient_flows_only_through_unclipped_model_tokens() -> None:
    logp, old_logp = policy_logp()
    loss, _ = grpo_loss(logp, old_logp, ADVANTAGES, MASK, config=GRPOLossConfig())
    loss.backward()
    # d(-A r)/d logp = -A r, divided by the 5 tokens; clipped and masked tokens get 0
    expected = torch.tensor([[0.0, -0.5 / 5, -1.1 / 5], [1.5 / 5, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_clipped_surrogate_sequence_aggregation() -> None:
    logp, old_logp = policy_logp()
    config = GRPOLossConfig(aggregation="sequence")
    loss, _ = grpo_loss(logp, old_logp, ADVANTAGES, MASK, config=config)
    # seq 0: (-1.2 - 0.5 - 1.1) / 3 = -0.93333; seq 1: (1.5 + 0.8) / 2 = 1.15
    assert loss.item() == pytest.approx((-2.8 / 3 + 1.15) / 2, abs=1e-6)


def test_clip_high_can_differ_from_clip_low() -> None:
    logp, old_logp = policy_logp()
    config = GRPOLossConfig(clip_high=0.28)
    loss, _ = grpo_loss(logp, old_logp, ADVANTAGES, MASK, config=config)
    # only seq 0 token 0 changes: min(1.5, 1.28) = 1.28
    assert loss.item() == pytest.approx((-1.28 - 0.5 - 1.1 + 1.5 + 0.8) / 5, abs=1e-6)


def test_dual_clip_bounds_negative_advantage_tokens() -> None:
    # seq 1 (A = -1) with ratios 4.0 and 1.5: unclipped losses +4.0 and +1.5; a dual clip
    # of 3 bounds the first at 3 * |A| = 3 and stops its gradient. Seq 0 (A = +1) is untouched.
    old_logp = torch.tensor([[-1.0, -2.0], [-0.7, -1.3]])
    logp = (old_logp + torch.tensor([[1.5, 0.5], [4.0, 1.5]]).log()).requires_grad_()
    loss, metrics = grpo_loss(logp, old_logp, ADVANTAGES, torch.ones(2, 2),
                              config=GRPOLossConfig(dual_clip=3.0))
    # (-1.2 - 0.5 + 3.0 + 1.5) / 4
    assert loss.item() == pytest.approx(2.8 / 4, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(2 / 4)
    loss.backward()
    expected = torch.tensor([[0.0, -0.5 / 4], [0.0, 1.5 / 4]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_importance_weights_are_truncated_and_detached() -> None:
    old_logp = torch.tensor([[LOG(0.6), LOG(0.1)]], requires_grad=True)
    behavior_logp = torch.tensor([[LOG(0.2), LOG(0.2)]])
    weights = importance_weights(old_logp, behavior_logp, cap=2.0)
    # exp(log 0.6 - log 0.2) = 3 -> capped at 2; exp(log 0.1 - log 0.2) = 0.5
    assert torch.allclose(weights, torch.tensor([[2.0, 0.5]]))
    assert not weights.requires_grad


def test_importance_weights_scale_each_token_of_the_loss() -> None:
    old_logp = torch.tensor([[LOG(0.6), LOG(0.1)]])
    logp = old_logp.clone().requires_grad_()  # ratio 1: the surrogate is -A per token
    behavior_logp = torch.tensor([[LOG(0.2), LOG(0.2)]])
    loss, metrics = grpo_loss(logp, old_logp, torch.tensor([1.0]), torch.ones(1, 2),
                              config=GRPOLossConfig(is_cap=2.0), behavior_logp=behavior_logp)
    # (-1 * 2 + -1 * 0.5) / 2
    assert loss.item() == pytest.approx(-1.25)
    assert metrics["is_weight_mean"] == pytest.approx(1.25)


def test_k3_kl_value_and_gradient() -> None:
    logp = torch.tensor([[LOG(0.5), LOG(0.3)]], requires_grad=True)
    ref_logp = torch.tensor([[LOG(0.25), LOG(0.3)]])
    kl = kl_k3(logp, ref_logp)
    # d = log 0.25 - log 0.5 = -log 2: e^d - d - 1 = 0.5 + 0.693147 - 1; equal probs give 0
    assert torch.allclose(kl, torch.tensor([[0.193147, 0.0]]), atol=1e-6)
    kl.sum().backward()
    # d/dlogp (e^(ref - logp) - (ref - logp) - 1) = 1 - e^(ref - logp) = 1 - 0.5
    assert torch.allclose(logp.grad, torch.tensor([[0.5, 0.0]]), atol=1e-6)


def test_k3_kl_is_bounded_per_token() -> None:
    # a token the policy moved 30 nats below the reference adds KL_BOUND and no gradient;
    # its neighbour keeps its own value and gradient
    logp = torch.tensor([[-30.0, LOG(0.5)]], requires_grad=True)
    ref_logp = torch.tensor([[0.0, LOG(0.25)]])
    kl = kl_k3(logp, ref_logp)
    assert kl[0, 0].item() == KL_BOUND
    kl.sum().backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.5]]), atol=1e-6)


def test_kl_penalty_is_added_per_token() -> None:
    logp = torch.tensor([[LOG(0.5), LOG(0.3)]], requires_grad=True)
    ref_logp = torch.tensor([[LOG(0.25), LOG(0.3)]])
    config = GRPOLossConfig(kl_coef=0.1)
    loss, metrics = grpo_loss(logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 2),
                              config=config, ref_logp=ref_logp)
    # advantage 0 leaves only 0.1 * (0.193147 + 0) / 2 tokens
    assert loss.item() == pytest.approx(0.1 * 0.193147 / 2, abs=1e-6)
    assert metrics["kl"] == pytest.approx(0.193147 / 2, abs=1e-6)


def test_masked_mean_skips_empty_sequences_in_sequence_mode() -> None:
    values = torch.tensor([[2.0, 4.0], [9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert masked_mean(values, mask, "sequence").item() == 3.0  # (2 + 4) / 2, seq 1 ignored
    assert masked_mean(values, mask, "token").item() == 3.0
    assert masked_mean(values, torch.zeros(2, 2), "token").item() == 0.0
