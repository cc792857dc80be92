"""The online objective as pure tensor functions: one rollout per prompt, off-policy.

Live traffic gives one completion per prompt, sampled by whatever release was serving; by
the time its feedback arrives the trainer has moved. So the update is a policy gradient with

- an advantage against a baseline (no group to compare within): A_i = r_i - b_i;
- a correction for the policy having moved since the logged behavior logprobs, one of two
  (`OnlineTrainerSettings.objective`):
  - `clipped` (default): PPO's clipped surrogate with its ratio anchored at the behavior
    policy, r_t = exp(logp_t - logp_behavior_t), as the bootstrap's GRPO does
    (`trainer/grpo.py`): -min(r_t A_i, clip(r_t, 1 - eps, 1 + eps) A_i), with the dual clip
    at `is_cap` x |A_i| for negative advantages. A token the policy already moved more than
    eps in its advantage's direction stops pulling, so a trainer that lags the traffic does
    not push stale experiences on and on;
  - `truncated_is`: truncated importance sampling, w_t = min(r_t, cap), detached, gradient
    w_t * A_i * grad logp_t (bounded variance, no trust region);
- a KL anchor to the served release, the k3 estimator on the sampled tokens:
  kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (>= 0, unbiased for KL(pi || ref)).

The loss is the token mean over the batch of the policy term plus kl_coef * kl_t.

    python -m pytest tests/trainer/online/test_loss.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.grpo import GRPOLossConfig, grpo_loss, importance_weights, kl_k3
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
    ratio: torch.Tensor  # () mean pi / pi_behavior (the IS weight, after the cap if truncated)
    clipped: torch.Tensor  # () fraction of tokens the clip or the cap cut

    def metrics(self) -> dict[str, float]:
        return {name: float(getattr(self, name).detach())
                for name in ("loss", "policy", "kl", "ratio", "clipped")}


def online_loss(logp: torch.Tensor, behavior_logp: torch.Tensor, ref_logp: torch.Tensor,
                adv: torch.Tensor, mask: torch.Tensor, *, is_cap: float, kl_coef: float
                ) -> OnlineLoss:
    """The `truncated_is` objective (module docstring).

    logp (B, T) trainer logprobs of the sampled tokens (with grad); behavior_logp (B, T) as
    served; ref_logp (B, T) under the served release (no grad); adv (B,) per row or (B, T)
    per token; mask (B, T) bool, true on completion tokens.
    """
    weights = truncated_is_weights(logp, behavior_logp, is_cap)  # (B, T)
    per_token = adv[:, None] if adv.dim() == 1 else adv  # (B, 1) | (B, T)
    policy = -(weights * per_token * logp)  # (B, T)
    kl = kl_k3(logp, ref_logp.detach())  # (B, T)
    loss = masked_mean(policy + kl_coef * kl, mask)
    raw = torch.exp(logp.detach() - behavior_logp)
    return OnlineLoss(loss=loss, policy=masked_mean(policy.detach(), mask),
                      kl=masked_mean(kl.detach(), mask),
                      ratio=masked_mean(weights, mask),
                      clipped=masked_mean((raw > is_cap).to(logp.dtype), mask))


def clipped_online_loss(logp: torch.Tensor, behavior_logp: torch.Tensor,
                        ref_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                        clip: float, is_cap: float, kl_coef: float) -> OnlineLoss:
    """The `clipped` objective (module docstring): `trainer.grpo.grpo_loss` with the ratio
    anchored at the behavior logprobs. Shapes as `online_loss`'s."""
    config = GRPOLossConfig(clip_low=clip, clip_high=clip, is_cap=None, dual_clip=is_cap,
                            kl_coef=kl_coef)
    loss, metrics = grpo_loss(logp, behavior_logp, adv, mask.to(logp.dtype), config=config,
                              ref_logp=ref_logp)
    kl = torch.tensor(metrics["kl"])
    return OnlineLoss(loss=loss, policy=loss.detach() - kl_coef * kl, kl=kl,
                      ratio=torch.tensor(metrics["ratio_mean"]),
                      clipped=torch.tensor(metrics["clip_fraction"]))
