"""Batch-invariant attention on CPU: prefill row t and decode step t give the same bits.

A query's output must not depend on the batch, the padding, the KV-cache length or how many
queries run together. The algorithm:
1. Compact keys: per batch row, the keys some query may read ("real" keys) move to the front in
   their original order (one row gather shared by all layers of a forward), so logical key j
   sits at index j whatever the padding (left, right, or holes in the middle).
2. Pad keys to a multiple of ``KEY_BLOCK`` and queries to a multiple of ``QUERY_TILE``, so every
   GEMM runs on full tiles with fixed shapes (see ``bi_ops``: that is what makes it invariant);
   elementwise work then runs on the real query rows only.
3. Two-pass softmax over fixed key blocks taken in order: the max is exact in any order; the
   sum of ``exp(s - max)`` and ``P @ V`` are reduced per block (fixed shape) and accumulated block
   after block. Masked keys contribute exact zeros, so keys past a row's length never change
   the sum, and blocks past every row's length are never computed.
Speed (decode is most of serving): exp never sees -inf or subnormal results (ATen's vector exp
takes a ~30x slower path for those), scores come from ``K @ Q^T`` so keys are used as stored,
and the per-mask work (compaction index, block masks) is done once per forward.
``attention_reference`` is Hugging Face's eager attention, the parity reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import inf
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.bi_ops import bi_bmm, bi_row_sum

KEY_BLOCK = 64  # keys reduced per GEMM; accumulation across blocks is sequential
QUERY_TILE = 16  # query rows per GEMM are padded to a multiple of this
EXP_FLOOR = -87.0  # exp(-87) ~ 1.6e-38, the smallest normal float32 result


def _allowed(
    mask: torch.Tensor | None, q_len: int, k_len: int, device: torch.device
) -> torch.Tensor:
    """Boolean "may attend" mask (B|1, 1|H, Tq, Tk); None means causal with queries last."""
    if mask is None:
        q_pos = torch.arange(k_len - q_len, k_len, device=device)
        return (torch.arange(k_len, device=device) <= q_pos[:, None])[None, None]
    if mask.dtype == torch.bool:
        return mask
    return mask == 0  # additive float mask: 0 keeps, a large negative value drops


@dataclass
class _Plan:
    """Everything about one mask that all layers of a forward share (built once per mask)."""

    take: torch.Tensor  # (blocks*G*KEY_BLOCK,) rows of keys.view(G*Tk, D), block-major
    blocks: int  # compacted keys = blocks * KEY_BLOCK
    q_pad: int  # zero query rows added to reach a multiple of QUERY_TILE
    dropped: list[torch.Tensor]  # per key block (G, rows, KEY_BLOCK) bool, True = masked


_last_plan: tuple[object, tuple[int, ...], _Plan] | None = None  # holds the mask: ids stay unique


def _plan(mask: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> _Plan:
    """Compaction index and per-block masks for (B, H, Hkv, Tq, Tk), cached on the mask object.

    Masks cover the real query rows only (``rows`` = H/Hkv * Tq per group): the padded rows
    exist for the GEMMs alone and are sliced off before any elementwise work.
    """
    global _last_plan
    if _last_plan is not None and _last_plan[0] is mask and _last_plan[1] == shape:
        return _last_plan[2]
    batch, heads, kv_heads, q_len, k_len = shape
    allowed = _allowed(mask, q_len, k_len, device).expand(batch, -1, q_len, k_len)
    real = allowed.any(dim=2).any(dim=1)  # (B, Tk): keys that some query reads
    blocks = -(-max(1, int(real.sum(-1).max())) // KEY_BLOCK)
    width, groups = blocks * KEY_BLOCK, batch * kv_heads
    order = torch.sort((~real).to(torch.int8), dim=-1, stable=True).indices  # (B, Tk)
    allowed = allowed.gather(-1, order[:, None, None, :].expand_as(allowed))
    allowed = F.pad(allowed[..., :width], (0, max(0, width - k_len)), value=False)
    # Slots past Tk read key 0: they are masked (p = 0), so they add exact zeros.
    slots = F.pad(order[:, :width], (0, max(0, width - k_len)))  # (B, width)
    base = torch.arange(groups, device=device).view(batch, kv_heads, 1) * k_len
    take = (base + slots[:, None, :]).view(groups, blocks, KEY_BLOCK).transpose(0, 1)
    rows = heads // kv_heads * q_len
    q_pad = max(QUERY_TILE, -(-rows // QUERY_TILE) * QUERY_TILE) - rows
    dropped = ~allowed.expand(batch, heads, -1, -1).reshape(groups, rows, width)
    plan = _Plan(take.reshape(-1), blocks, q_pad,
                 [dropped[..., j : j + KEY_BLOCK].contiguous() for j in range(0, width, KEY_BLOCK)])
    _last_plan = (mask, shape, plan)
    return plan


def _compact(x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """Keys or values (B, Hkv, Tk, D) -> (blocks, B*Hkv, KEY_BLOCK, D): real keys first."""
    rows = x.reshape(-1, x.shape[3]).index_select(0, plan.take)  # one row gather
    return rows.view(plan.blocks, -1, KEY_BLOCK, x.shape[3])


def bi_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Attention with a fixed reduction order. query (B, H, Tq, D), key/value (B, Hkv, Tk, D),
    mask bool/additive (B|1, 1|H, Tq, Tk) or None (causal) -> (B, Tq, H, D)."""
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    plan = _plan(mask, (batch, heads, kv_heads, q_len, k_len), query.device)
    groups, rows = batch * kv_heads, heads // kv_heads * q_len
    # Grouped-query layout: the query heads sharing a KV head are stacked along rows (r*Tq + t),
    # zero rows pad them to full GEMM tiles (a row's bits do not depend on its place or on M).
    q_t = query.new_zeros(groups, dim, rows + plan.q_pad)  # (G, D, M): Q^T
    q_t[..., :rows].view(batch, kv_heads, dim, rows // q_len, q_len).copy_(
        query.view(batch, kv_heads, rows // q_len, q_len, dim).permute(0, 1, 4, 2, 3))
    keys, values = _compact(key, plan), _compact(value, plan)  # (blocks, G, KEY_BLOCK, D)
    scores = [  # (G, rows, KEY_BLOCK) each, row-major (row reductions see one layout)
        (bi_bmm(k, q_t)[..., :rows].transpose(1, 2).contiguous() * scaling)
        .masked_fill_(drop, -inf)
        for k, drop in zip(keys, plan.dropped, strict=True)  # K @ Q^T: K as stored
    ]
    # the shift is a constant of the softmax (its gradient cancels): detached, as usual
    top = scores[0].detach().amax(-1, keepdim=True)
    for s in scores[1:]:
        top = torch.maximum(top, s.detach().amax(-1, keepdim=True))  # exact in any order
    top = top.clamp_(min=torch.finfo(top.dtype).min)  # rows with no key: finite, every p is 0
    total: torch.Tensor | None = None  # (G, rows, 1)
    out: torch.Tensor | None = None  # (G, rows, D)
    for drop, s, v in zip(plan.dropped, scores, values, strict=True):  # blocks in a fixed order
        # exp of inputs below EXP_FLOOR (subnormal results, -inf) takes ATen's slow path; the
        # floor changes nothing that survives: masked keys are zeroed, the rest are < 1e-37.
        p = torch.exp((s - top).clamp_(min=EXP_FLOOR))
        # in place only where autograd does not keep exp's result for the backward
        p = p.masked_fill(drop, 0.0) if torch.is_grad_enabled() else p.masked_fill_(drop, 0.0)
        part = bi_bmm(F.pad(p, (0, 0, 0, plan.q_pad)), v)[:, :rows]
        total = bi_row_sum(p) if total is None else total + bi_row_sum(p)
        out = part if out is None else out + part
    assert total is not None and out is not None  # at least one key block
    out = out / total.clamp(min=1.0)  # total >= 1 (the max key adds exp(0)), or 0: no key
    return out.view(batch, heads, q_len, dim).transpose(1, 2).contiguous()


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Hugging Face's eager attention with the same signature and output layout (B, Tq, H, D)."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    allowed = _allowed(mask, query.shape[2], key.shape[2], query.device)
    bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
    bias = bias.masked_fill(~allowed, torch.finfo(query.dtype).min)
    weights = torch.softmax(torch.matmul(query, key.transpose(2, 3)) * scaling + bias, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


def hf_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Adapter with the signature of transformers' ``AttentionInterface`` functions."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return bi_attention(query, key, value, attention_mask, scale), None


def hf_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' boolean sdpa mask, never skipped: padding must reach ``bi_attention``."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)
