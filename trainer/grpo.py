"""GRPO math as pure tensor functions: advantages, importance weights, KL, the clipped loss.

Shapes: B sequences (a batch of whole groups), T token positions, G groups of N samples.
Per-token tensors are (B, T) and aligned: position t holds the log-probability of token t.
`loss_mask` is 1 on tokens the policy generated and 0 on prompt, tool-observation and padding
tokens, which are context only and must not be trained on.

Three log-probabilities meet here: `logp` from the policy being trained (with grad), `old_logp`
from the same trainer before this update's first step (the PPO anchor), and `behavior_logp`
from the inference engine that sampled the tokens. The engine's numerics differ from the
trainer's, so the sampled distribution is corrected with a truncated importance weight
min(exp(old_logp - behavior_logp), C), detached.

With one optimizer step per batch the anchor is the policy being trained, so the ratio starts
at 1 and the clip never engages, however stale the batch. Anchoring at the behavior logprobs
instead (`old_logp = behavior_logp`, no separate weight) makes the clip a trust region around
the policy that sampled: tokens the policy has already moved past 1 +- clip in the advantage's
direction stop pulling. `dual_clip` then bounds a negative-advantage token's loss at
dual_clip x |A| (Ye et al., 2020), where the ratio itself is unbounded.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, Field
from torch import Tensor

Aggregation = Literal["token", "sequence"]


class GRPOLossConfig(BaseModel):
    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0)  # ratio floor 1 - clip_low
    clip_high: float = Field(default=0.2, ge=0.0)  # ratio ceiling 1 + clip_high
    is_cap: float | None = Field(default=2.0, gt=0.0)  # C; None: no behavior correction
    dual_clip: float | None = Field(default=None, gt=1.0)  # c; None: negative A unbounded
    kl_coef: float = Field(default=0.0, ge=0.0)
    aggregation: Aggregation = "token"


def group_advantages(rewards: Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """(reward - group mean) / (group std + eps); rewards (G, N) -> advantages (G, N).

    The std is the unbiased sample std (N - 1), as in DeepSeekMath. `scale_by_std=False` keeps
    only the baseline (Dr. GRPO): no up-weighting of groups whose rewards barely differ.
    """
    centered = rewards - rewards.mean(dim=1, keepdim=True)  # (G, N)
    if not scale_by_std:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True) + eps)  # (G, N)


def importance_weights(old_logp: Tensor, behavior_logp: Tensor, *, cap: float) -> Tensor:
    """min(exp(old_logp - behavior_logp), cap), detached; (B, T) -> (B, T)."""
    return torch.exp(old_logp - behavior_logp).clamp(max=cap).detach()


KL_BOUND = 10.0  # the most one token's k3 term may add (verl's "low_var_kl" bound)


def kl_k3(logp: Tensor, ref_logp: Tensor, bound: float = KL_BOUND) -> Tensor:
    """Schulman's k3 estimator of KL(policy || reference) per token: e^d - d - 1, d = ref - logp,
    at most `bound`.

    Non-negative and unbiased for samples drawn from the policy; (B, T) -> (B, T). Unbounded,
    one token the policy has moved far below the reference (d = 7.3: e^d = 1485) outweighs
    the batch's thousands of others, and once the step's gradient is clipped to its norm the
    whole update goes into that token: online runs at lr 3e-4 spent steps so, KL 1485 and
    gradient norm 4102 against the usual 0.3 and 1.5. Bounded, a token past d ~ 2.6 stops
    pulling (the clamp passes no gradient), as in verl; the policy term's clip still holds it.
    """
    log_ratio = (ref_logp - logp).clamp(max=20.0)  # e^20 stays finite in float32
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(max=bound)


def masked_mean(values: Tensor, mask: Tensor, aggregation: Aggregation) -> Tensor:
    """Average over masked tokens: "token" = sum over all tokens / token count (long answers
    weigh more), "sequence" = mean of per-sequence means over sequences with any token."""
    mask = mask.to(values.dtype)  # (B, T)
    if aggregation == "token":
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    tokens = mask.sum(dim=1)  # (B,)
    per_sequence = (values * mask).sum(dim=1) / tokens.clamp(min=1.0)  # (B,)
    present = (tokens > 0).to(values.dtype)  # (B,)
    return (per_sequence * present).sum() / present.sum().clamp(min=1.0)


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    config: GRPOLossConfig,
    behavior_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The clipped surrogate, IS-corrected and KL-penalized; returns (scalar loss, metrics).

    logp, old_logp, loss_mask, behavior_logp, ref_logp: (B, T); advantages: (B,), one per
    sequence, broadcast over its tokens, or (B, T), one per token.
    """
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) | (B, T)
    ratio = torch.exp(logp - old_logp.detach())  # (B, T)
    clipped_ratio = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)  # (B, T)
    unclipped, clipped = ratio * adv, clipped_ratio * adv  # (B, T)
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    was_clipped = clipped < unclipped  # the min took the clipped term
    if config.dual_clip is not None:
        bounded = (adv < 0) & (per_token > config.dual_clip * -adv)  # (B, T)
        per_token = torch.where(bounded, config.dual_clip * -adv, per_token)
        was_clipped = was_clipped | bounded
    weights = torch.ones_like(ratio)
    if behavior_logp is not None and config.is_cap is not None:
        weights = importance_weights(old_logp, behavior_logp, cap=config.is_cap)
        per_token = per_token * weights
    kl = torch.zeros_like(ratio)
    if ref_logp is not None and config.kl_coef > 0:
        kl = kl_k3(logp, ref_logp.detach())
        per_token = per_token + config.kl_coef * kl
    loss = masked_mean(per_token, loss_mask, config.aggregation)
    with torch.no_grad():
        metrics = {name: masked_mean(value, loss_mask, "token").item() for name, value in (
            ("clip_fraction", was_clipped.to(ratio.dtype)), ("ratio_mean", ratio),
            ("is_weight_mean", weights), ("kl", kl))}
    return loss, metrics
