"""The online objective as pure tensor functions: one rollout per prompt, off-policy.

Live traffic gives one completion per prompt, sampled by whatever release was serving; by
the time its feedback arrives the trainer has moved. So the update is REINFORCE with

- an advantage against a baseline (no group to compare within): A_i = r_i - b_i;
- truncated importance sampling (TIS) against the logged behavior logprobs:
  w_t = min(exp(logp_t - logp_behavior_t), cap), detached, so the gradient is
  w_t * A_i * grad logp_t (bounded variance, small bias when the policy moved a lot);
- a KL anchor to the served release, the k3 estimator on the sampled tokens:
  kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (>= 0, unbiased for KL(pi || ref)).

The loss is the token mean over the batch: mean_t[-w_t * A_i * logp_t + kl_coef * kl_t].

    python -m pytest tests/trainer/test_online_loss.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.grpo import importance_weights, kl_k3
from trainer.grpo import masked_mean as grpo_masked_mean


def leave_one_out_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """b_i = mean of the other rows' rewards. (B,) -> (B,); B == 1 gives 0."""
    count = rewards.shape[0]
    if count < 2:
        return torch.zeros_like(rewards)
    return (rewards.sum() - rewards) / (count - 1)


def running_mean_update(mean: float, count: int, value: float, decay: float
                        ) -> tuple[float, int]:
    """One step of a running mean: exact for the first 1/decay values, then an EMA."""
    step = max(1.0 / (count + 1), decay)
    return mean + step * (value - mean), count + 1


def advantages(rewards: torch.Tensor, baselines: torch.Tensor, *, normalize: bool = False
               ) -> torch.Tensor:
    """A_i = r_i - b_i, optionally divided by the batch std. (B,), (B,) -> (B,)."""
    adv = rewards - baselines
    if normalize and adv.shape[0] > 1:
        adv = adv / (adv.std() + 1e-6)
    return adv


def truncated_is_weights(logp: torch.Tensor, behavior_logp: torch.Tensor, cap: float
                         ) -> torch.Tensor:
    """w = min(pi / mu, cap) per token, no gradient. (B, T), (B, T) -> (B, T).

    One update per batch, so the GRPO "old" policy is the current one (trainer/grpo.py).
    """
    return importance_weights(logp.detach(), behavior_logp, cap=cap)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token mean over the positions where mask is true. (B, T), (B, T) -> ()."""
    return grpo_masked_mean(values, mask, "token")


@dataclass(frozen=True)
class OnlineLoss:
    loss: torch.Tensor  # () the scalar to backpropagate
    policy: torch.Tensor  # () the policy-gradient term
    kl: torch.Tensor  # () mean k3 KL to the reference
    is_weight: torch.Tensor  # () mean truncated importance weight
    truncated: torch.Tensor  # () fraction of tokens whose weight hit the cap

    def metrics(self) -> dict[str, float]:
        return {name: float(getattr(self, name).detach())
                for name in ("loss", "policy", "kl", "is_weight", "truncated")}


def online_loss(logp: torch.Tensor, behavior_logp: torch.Tensor, ref_logp: torch.Tensor,
                adv: torch.Tensor, mask: torch.Tensor, *, is_cap: float, kl_coef: float
                ) -> OnlineLoss:
    """The online objective (module docstring).

    logp (B, T) trainer logprobs of the sampled tokens (with grad); behavior_logp (B, T) as
    served; ref_logp (B, T) under the served release (no grad); adv (B,); mask (B, T) bool,
    true on completion tokens.
    """
    weights = truncated_is_weights(logp, behavior_logp, is_cap)  # (B, T)
    policy = -(weights * adv[:, None] * logp)  # (B, T)
    kl = kl_k3(logp, ref_logp.detach())  # (B, T)
    loss = masked_mean(policy + kl_coef * kl, mask)
    raw = torch.exp(logp.detach() - behavior_logp)
    return OnlineLoss(loss=loss, policy=masked_mean(policy.detach(), mask),
                      kl=masked_mean(kl.detach(), mask),
                      is_weight=masked_mean(weights, mask),
                      truncated=masked_mean((raw > is_cap).to(logp.dtype), mask))
