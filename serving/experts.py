"""A MoE layer's half of the lean decode step (serving/decode.py): the router's math, and the
chosen experts run per (token, expert) pair for few tokens, per expert on oneDNN copies, or as
one grouped GEMM per projection for many."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from serving.onednn import OneDnnWeights


def route(router: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers top-k router's (weights, experts), both (B, K), with its math: softmax
    over every expert in float32, top-k, renormalized if it does (Mixtral's always does). Its
    module is not called, so route-capture hooks (which the recorder fills per model call) stay
    out of a decode step."""
    probs = torch.softmax(F.linear(x, router.weight), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, router.top_k, dim=-1)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def run_experts(experts: Any, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                onednn: OneDnnWeights | None = None) -> torch.Tensor:
    """The weighted sum of each row's top-k experts: (B, H) from x (B, H), weights and
    chosen (B, K). Few tokens: each (token, expert) pair as one matrix-vector product on that
    expert's weights; more: the pairs grouped by expert, two GEMMs per expert on its oneDNN
    copies (`onednn`), or one grouped GEMM per projection."""
    rows, k = chosen.shape
    gate_up, down = experts.gate_up_proj, experts.down_proj  # (E, 2I, H), (E, H, I)
    flat = chosen.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)  # (B*K, H), pair order
    if rows * k <= gate_up.shape[0]:  # gathering the pairs' weights costs less than a GEMM
        # (serving.decode's LeanDecoder.grouped_from: the first row count past this)
        gate, up = torch.bmm(gate_up[flat], xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        out = torch.bmm(down[flat], (experts.act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)
    elif onednn is not None:
        out = per_expert_gemms(experts, xs, flat, onednn)
    else:
        out = grouped_gemms(experts, xs, flat)
    return (out.view(rows, k, -1) * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)


def per_expert_gemms(experts: Any, xs: torch.Tensor, flat: torch.Tensor,
                     onednn: OneDnnWeights) -> torch.Tensor:
    """Each (token, expert) pair's expert output, (N, H) for xs (N, H) and experts flat (N,):
    pairs sorted by expert, then per expert hit two GEMMs on its oneDNN weights."""
    gate_ups, downs = onednn.experts(experts.gate_up_proj), onednn.experts(experts.down_proj)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=len(gate_ups)).tolist()
    grouped, out = xs[order], torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            pairs = order[start:start + n]
            gate, up = onednn.apply(gate_ups[expert], grouped[start:start + n]).chunk(2, dim=-1)
            out[pairs] = onednn.apply(downs[expert], experts.act_fn(gate) * up)
            start += n
    return out


def grouped_gemms(experts: Any, xs: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Each (token, expert) pair's expert output, (N, H) for xs (N, H) and experts flat (N,):
    pairs sorted by expert, one grouped GEMM per projection."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    order = flat.argsort(stable=True)
    ends = torch.bincount(flat, minlength=gate_up.shape[0]).cumsum(0).to(torch.int32)
    gate, up = F.grouped_mm(xs[order], gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    out = torch.empty_like(xs)
    out[order] = F.grouped_mm(experts.act_fn(gate) * up, down.transpose(1, 2), offs=ends)
    return out
