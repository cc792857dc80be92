"""The batch-invariant switch: one call makes a transformers model's forward batch-invariant.

Serving and the trainer call the same thing on the same Hugging Face model class and keep using
HF's own forward (prefill, DynamicCache decode, full-sequence training):

    enable_batch_invariant(model)          # or: with batch_invariant(model): ...
    logits = model(input_ids=..., attention_mask=..., position_ids=...,
                   past_key_values=cache, use_cache=True).logits
    logprobs = token_logprobs(logits, tokens)   # kernels.bi_ops, for sampling and training alike

What it swaps (instance-level forwards and transformers' own registries, so parameter names,
state dicts and hooks are untouched; ``disable_batch_invariant`` restores everything):
- every ``nn.Linear`` -> ``bi_linear``; every ``*RMSNorm`` -> ``bi_rms_norm``; SiLU modules ->
  ``bi_silu``; top-k MoE routers -> the same routing with ``bi_linear`` logits;
- attention -> ``bi_attention`` via ``AttentionInterface`` (and a never-skipped boolean mask);
- MoE experts -> ``bi_experts_forward`` via ``ExpertsInterface``.
Embedding lookups, RoPE (elementwise mul/cos/sin), residual adds and top-k are already exact.

Devices: on CPU the ops are ATen kernels used so that their results cannot depend on the batch
(see ``kernels.bi_ops``); CUDA tensors go to the Triton kernels of ``kernels.triton_ops`` (GEMMs,
softmax/log-softmax, row sums, RMSNorm), picked per tensor by the same functions, so one switch
serves both. Other devices are refused. The vLLM backend gets the same property from vLLM
itself: ``serving.vllm_engine`` starts it with ``VLLM_BATCH_INVARIANT=1``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.bi_attention import hf_attention_forward, hf_mask
from kernels.bi_ops import (
    BatchInvariantUnsupported,
    bi_bmm,
    bi_linear,
    bi_rms_norm,
    bi_row_sum,
    bi_silu,
    bi_softmax,
    triton_kernels,
)

EXPERT_COLS = 16  # expert segments hold a multiple of this many tokens (see bi_experts_forward)
IMPLEMENTATION = "flywheel_batch_invariant"  # name registered in transformers' interfaces
_STATE_ATTR = "_flywheel_batch_invariant"


@dataclass
class _SwitchState:
    """What ``enable_batch_invariant`` changed, so that ``disable_batch_invariant`` undoes it."""

    attn_implementation: Any
    experts_implementation: Any
    patched: list[nn.Module] = field(default_factory=list)


def _register() -> None:
    """Register the attention, mask and experts functions with transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, hf_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, hf_mask)
    ExpertsInterface.register(IMPLEMENTATION, bi_experts_forward)


__all__ = [
    "BatchInvariantUnsupported", "batch_invariant", "bi_experts_forward",
    "disable_batch_invariant", "enable_batch_invariant", "is_batch_invariant",
]


def bi_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts with fixed-shape GEMMs and a fixed summation order.

    hidden (N, H), top_k_index (N, K), top_k_weights (N, K) -> (N, H). Each expert's tokens are
    gathered into a segment padded to a multiple of EXPERT_COLS, and one grouped GEMM computes
    W_e @ X_e^T per segment: the tokens are GEMM *columns*, and a column's bits depend neither
    on the column count nor on its place once that count is a multiple of EXPERT_COLS, while
    the rows (the expert's output features) are fixed by the weights. MKL on AVX-512 (Intel)
    was invariant from 4 columns; on AMD EPYC (AVX2 kernels) 4 and 8 were not, 16 is. A token's
    output is the sum of its experts' weighted outputs in ascending expert id, as in the eager
    loop. Expert ids >= num_experts (expert-parallel sentinels) contribute zero.
    """
    if getattr(self, "is_transposed", False) or getattr(self, "has_bias", False):
        raise BatchInvariantUnsupported(f"{type(self).__name__}: transposed/biased experts")
    n, k = top_k_index.shape
    num = self.num_experts
    experts, slot = top_k_index.sort(dim=-1)  # (N, K): each token's experts ascending
    flat = experts.reshape(-1)  # pair p = token * K + j
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat, minlength=num + 1)  # ids >= num: expert-parallel sentinels
    pad = (-counts).remainder_(EXPERT_COLS)  # zero tokens closing each expert's segment
    ends = torch.cumsum(counts + pad, 0)
    limits = ends[num - 1 :].tolist()
    rows, total = limits[0], limits[-1]  # rows of real experts; with the sentinels' rows
    if rows == 0:
        return hidden_states.new_zeros(hidden_states.shape)
    # the i-th pair in expert order goes to row i + (padding rows of the experts before it)
    dest = (torch.cumsum(pad, 0) - pad)[flat[order]] + torch.arange(n * k, device=flat.device)
    buf = hidden_states.new_zeros(total, hidden_states.shape[1]).index_copy_(
        0, dest, hidden_states[order // k])[:rows]  # (rows, H): zero-padded expert segments
    offs = ends[:num].to(torch.int32)
    gate, up = _grouped_mm(self.gate_up_proj, buf.t(), offs).chunk(2, dim=0)  # (I, rows) each
    down = _grouped_mm(self.down_proj, bi_silu(gate) * up, offs).t()  # (rows, H)
    pair_row = torch.empty_like(dest).index_copy_(0, order, dest)  # pair p -> its row
    weights = top_k_weights.gather(-1, slot)  # (N, K) in ascending expert order
    if total > rows:  # sentinels: read row 0 with weight 0
        sentinel = experts >= num
        pair_row = pair_row.masked_fill_(sentinel.view(-1), 0)
        weights = weights.masked_fill(sentinel, 0.0)
    contrib = down.index_select(0, pair_row).view(n, k, -1) * weights[..., None]  # (N, K, H)
    out = contrib[:, 0]
    for j in range(1, k):  # fixed order: ascending expert id
        out = out + contrib[:, j]
    return out


def _grouped_mm(weight: torch.Tensor, x_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """weight[e] (Out, In) times columns offs[e-1]:offs[e] of x_t (In, cols); cols = offs[-1].

    On CPU, ATen runs one GEMM per group (``torch.mm`` on that slice); on CUDA, one fixed-tile
    Triton GEMM per non-empty group. -> (Out, cols)
    """
    if not x_t.is_cuda:
        return F.grouped_mm(weight, x_t, offs=offs)
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([bi_bmm(weight[e : e + 1], x_t[None, :, a:b])[0]
                      for e, (a, b) in enumerate(zip(starts, ends, strict=True)) if b > a], 1)


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return bi_linear(x, self.weight, self.bias)


def _rms_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return bi_rms_norm(x, self.weight, self.variance_epsilon)


def _silu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return bi_silu(x)


def _router_forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """transformers' top-k router with batch-invariant logits. -> logits, weights, indices."""
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    logits = bi_linear(hidden_states, self.weight)  # (N, E)
    probs = bi_softmax(logits, dim=-1)
    top, indices = torch.topk(probs, self.top_k, dim=-1)  # (N, K)
    if getattr(self, "norm_topk_prob", True):  # Mixtral has no flag and always normalises
        top = top / bi_row_sum(top)
    return logits, top.to(logits.dtype), indices


def _patch_for(module: nn.Module) -> Any:
    """The batch-invariant forward for ``module``, or None when it is already invariant."""
    name = type(module).__name__
    if isinstance(module, nn.Linear):
        return _linear_forward
    if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
        return _rms_norm_forward
    if isinstance(module, nn.SiLU) or name == "SiLUActivation":
        return _silu_forward
    if is_topk_router(module):
        return _router_forward
    return None


def enable_batch_invariant(model: nn.Module) -> nn.Module:
    """Make ``model``'s forward batch-invariant in place (idempotent); returns the model."""
    if getattr(model, _STATE_ATTR, None) is not None:
        return model
    devices = {p.device.type for p in model.parameters()}
    if devices - {"cpu", "cuda"}:
        raise BatchInvariantUnsupported(f"no batch-invariant kernels for {sorted(devices)}")
    if "cuda" in devices:
        triton_kernels()  # raises BatchInvariantUnsupported without triton
    _register()
    hf: Any = model
    # transformers 5.19 has no getter for the attention implementation to restore later
    # (set_attn_implementation has none; experts have get_experts_implementation):
    # tests/kernels/test_batch_invariant.py::test_switch_restores_stock_forward reads it too
    state = _SwitchState(hf.config._attn_implementation, hf.get_experts_implementation())
    for module in model.modules():
        patch = _patch_for(module)
        if patch is not None:
            # an instance's forward replaced: transformers has no public way to swap the
            # computation of Linear/RMSNorm/SiLU/router modules (its kernel hub downloads)
            module.forward = MethodType(patch, module)  # type: ignore[method-assign]
            state.patched.append(module)
    hf.set_attn_implementation(IMPLEMENTATION)
    hf.set_experts_implementation(IMPLEMENTATION)
    setattr(model, _STATE_ATTR, state)
    return model


def disable_batch_invariant(model: nn.Module) -> nn.Module:
    """Undo ``enable_batch_invariant``: stock forwards and implementations again."""
    state: _SwitchState | None = getattr(model, _STATE_ATTR, None)
    if state is None:
        return model
    for module in state.patched:
        del module.forward
    hf: Any = model
    hf.set_attn_implementation(state.attn_implementation)
    hf.set_experts_implementation(state.experts_implementation)
    setattr(model, _STATE_ATTR, None)
    return model


def is_topk_router(module: nn.Module) -> bool:
    """transformers' MoE routers (``*TopKRouter``), which return (logits, weights, indices)."""
    name = type(module).__name__
    return name.endswith("TopKRouter") and hasattr(module, "top_k") and hasattr(module, "weight")


def is_batch_invariant(model: nn.Module) -> bool:
    """Whether ``enable_batch_invariant`` is in effect on ``model``."""
    return getattr(model, _STATE_ATTR, None) is not None


@contextmanager
def batch_invariant(model: nn.Module, enabled: bool = True) -> Iterator[nn.Module]:
    """``enable_batch_invariant`` for the duration of the block (no-op when not ``enabled``)."""
    was_on = is_batch_invariant(model)
    if enabled:
        enable_batch_invariant(model)
    try:
        yield model
    finally:
        if enabled and not was_on:
            disable_batch_invariant(model)
