"""The online objective's pure functions, checked against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.online.loss import (
    advantages,
    clipped_online_loss,
    kl_k3,
    leave_one_out_baseline,
    masked_mean,
    online_loss,
    running_mean_update,
    truncated_is_weights,
)

LN = math.log


def test_leave_one_out_baseline_is_the_mean_of_the_others() -> None:
    # sum = 2: b_i = (2 - r_i) / 3
    b = leave_one_out_baseline(torch.tensor([1.0, 0.0, -1.0, 2.0]))
    assert b.tolist() == pytest.approx([1 / 3, 2 / 3, 1.0, 0.0])
    assert leave_one_out_baseline(torch.tensor([5.0])).tolist() == [0.0]


def test_running_mean_is_exact_then_exponential() -> None:
    assert running_mean_update(0.0, 0, 1.0, 0.1) == (1.0, 1)  # step 1
    assert running_mean_update(1.0, 1, 0.0, 0.1) == (0.5, 2)  # step 1/2
    mean, count = running_mean_update(0.5, 20, 1.0, 0.1)  # step max(1/21, 0.1) = 0.1
    assert (mean, count) == (pytest.approx(0.55), 21)


def test_advantages_subtract_the_baseline_and_optionally_normalize() -> None:
    adv = advantages(torch.tensor([1.0, -1.0]), torch.tensor([0.5, 0.5]))
    assert adv.tolist() == [0.5, -1.5]
    norm = advantages(torch.tensor([1.0, -1.0]), torch.tensor([0.0, 0.0]), normalize=True)
    # std of [1, -1] (unbiased) = sqrt(2)
    assert norm.tolist() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], rel=1e-5)


def test_importance_weights_are_truncated_and_detached() -> None:
    logp = torch.tensor([[LN(0.5), LN(0.25)]], requires_grad=True)
    behavior = torch.tensor([[LN(0.25), LN(0.5)]])
    w = truncated_is_weights(logp, behavior, cap=1.5)  # ratios 2 and 0.5
    assert w.tolist()[0] == pytest.approx([1.5, 0.5])
    assert not w.requires_grad


def test_kl_k3_by_hand() -> None:
    # delta = ln .25 - ln .5 = -ln 2: exp(delta) - delta - 1 = 0.5 + ln 2 - 1
    kl = kl_k3(torch.tensor([[LN(0.5), LN(0.3)]]), torch.tensor([[LN(0.25), LN(0.3)]]))
    assert kl.tolist()[0] == pytest.approx([0.5 + LN(2) - 1, 0.0], abs=1e-7)


def test_masked_mean_ignores_padding() -> None:
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert float(masked_mean(values, mask)) == pytest.approx(2.0)


def test_online_loss_value_and_gradient_by_hand() -> None:
    # Row 0: on-policy (w = 1), A = 2; row 1: ratio 4 truncated to 2, A = -1.
    logp = torch.tensor([[LN(0.5), LN(0.9)], [LN(0.8), LN(0.7)]], requires_grad=True)
    behavior = torch.tensor([[LN(0.5), LN(0.9)], [LN(0.2), LN(0.7)]])
    mask = torch.tensor([[True, False], [True, False]])
    out = online_loss(logp, behavior, logp.detach(), torch.tensor([2.0, -1.0]), mask,
                      is_cap=2.0, kl_coef=0.5)
    # policy terms: -(1 * 2 * ln .5) = 2 ln 2 ; -(2 * -1 * ln .8) = 2 ln .8 ; kl = 0
    expected = (2 * LN(2) + 2 * LN(0.8)) / 2
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-6)
    assert float(out.ratio) == pytest.approx(1.5)
    assert float(out.clipped) == pytest.approx(0.5)
    out.loss.backward()
    # d/dlogp: -w * A / n_tokens (+ kl_coef * (1 - exp(ref - logp)) / n = 0 at ref == logp)
    assert logp.grad.flatten().tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0])


def test_kl_anchor_pulls_towards_the_reference() -> None:
    logp = torch.tensor([[LN(0.5)]], requires_grad=True)
    ref = torch.tensor([[LN(0.25)]])
    out = online_loss(logp, logp.detach(), ref, torch.tensor([0.0]),
                      torch.tensor([[True]]), is_cap=2.0, kl_coef=1.0)
    assert float(out.kl) == pytest.approx(0.5 + LN(2) - 1)
    out.loss.backward()
    # d kl / d logp = 1 - exp(ref - logp) = 1 - 0.5: descent lowers logp towards ref
    assert float(logp.grad) == pytest.approx(0.5)


def test_clipped_objective_stops_tokens_the_policy_already_moved() -> None:
    """Anchored at the behavior logprobs: a token whose ratio is past 1 + clip in its
    advantage's direction gives no gradient; one inside the clip gives -r A / n."""
    logp = torch.tensor([[LN(0.5)], [LN(0.8)], [LN(0.5)]], requires_grad=True)
    behavior = torch.tensor([[LN(0.5)], [LN(0.4)], [LN(0.5)]])  # ratios 1, 2, 1
    mask = torch.ones(3, 1, dtype=torch.bool)
    out = clipped_online_loss(logp, behavior, logp.detach(), torch.tensor([1.0, 1.0, -1.0]),
                              mask, clip=0.2, is_cap=3.0, kl_coef=0.1)
    # -(1 * 1) - (1.2 * 1) + (1 * 1), over 3 tokens; kl = 0
    assert float(out.loss.detach()) == pytest.approx((-1.0 - 1.2 + 1.0) / 3, rel=1e-6)
    assert float(out.clipped) == pytest.approx(1 / 3) and float(out.ratio) == pytest.approx(4 / 3)
    out.loss.backward()
    # d/dlogp of -r A = -r A (r = exp(logp - behavior)); the clipped token has none
    assert logp.grad.flatten().tolist() == pytest.approx([-1 / 3, 0.0, 1 / 3])
