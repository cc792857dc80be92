"""Batch-invariant attention on CPU: prefill row t and decode step t give the same bits.

A query's output must not depend on the batch, the padding, the KV-cache length or how many
queries run together. The algorithm:
1. Compact keys: per batch row, the keys some query may read ("real" keys) move to the front in
   their original order (stable sort), so logical key j sits at index j whatever the padding
   (left, right, or holes in the middle).
2. Pad queries to a multiple of ``QUERY_TILE`` and keys to a multiple of ``KEY_BLOCK``, so every
   GEMM runs on full tiles with fixed shapes (see ``bi_ops``: that is what makes it invariant).
3. Two-pass softmax over fixed key blocks taken in order: the max is exact in any order; the
   sum of ``exp(s - max)`` and ``P @ V`` are reduced per block (fixed shape) and accumulated block
   after block. Masked keys contribute exact zeros, so keys past a row's length never change
   the sum, and blocks past every row's length are never computed.
``attention_reference`` is Hugging Face's eager attention, the parity reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import inf
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

KEY_BLOCK = 64  # keys reduced per GEMM; accumulation across blocks is sequential
QUERY_TILE = 16  # query rows per GEMM are padded to a multiple of this


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

    order: torch.Tensor | None  # (B, Tk): real keys first, None when every key is real
    width: int  # compacted key count, a multiple of KEY_BLOCK
    q_pad: int  # zero query rows added to reach a multiple of QUERY_TILE
    dropped: list[torch.Tensor]  # per key block (G, rows, KEY_BLOCK) bool, True = masked


_last_plan: tuple[object, tuple[int, ...], _Plan] | None = None  # holds the mask: ids stay unique


def _plan(mask: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> _Plan:
    """Compaction order and per-block masks for (B, H, Hkv, Tq, Tk), cached on the mask object."""
    global _last_plan
    if _last_plan is not None and _last_plan[0] is mask and _last_plan[1] == shape:
        return _last_plan[2]
    batch, heads, kv_heads, q_len, k_len = shape
    allowed = _allowed(mask, q_len, k_len, device).expand(batch, -1, q_len, k_len)
    real = allowed.any(dim=2).any(dim=1)  # (B, Tk): keys that some query reads
    width = -(-max(1, int(real.sum(-1).max())) // KEY_BLOCK) * KEY_BLOCK
    order = None
    if not bool(real.all()):
        order = torch.sort((~real).to(torch.int8), dim=-1, stable=True).indices
        allowed = allowed.gather(-1, order[:, None, None, :].expand_as(allowed))
    q_pad = -(-q_len // QUERY_TILE) * QUERY_TILE - q_len
    allowed = F.pad(allowed[..., :width], (0, max(0, width - k_len), 0, q_pad), value=False)
    rows = heads // kv_heads * (q_len + q_pad)
    dropped = ~allowed.expand(batch, heads, -1, -1).reshape(batch * kv_heads, rows, width)
    blocks = [dropped[..., j : j + KEY_BLOCK].contiguous() for j in range(0, width, KEY_BLOCK)]
    plan = _Plan(order, width, q_pad, blocks)
    _last_plan = (mask, shape, plan)
    return plan


def _compact(x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """Keys or values (B, Hkv, Tk, D) -> (B*Hkv, width, D), real keys first, zero-padded."""
    if plan.order is not None:
        x = x.gather(2, plan.order[:, None, :, None].expand_as(x))
    x = F.pad(x[:, :, : plan.width], (0, 0, 0, max(0, plan.width - x.shape[2])))
    return x.reshape(x.shape[0] * x.shape[1], plan.width, x.shape[3])


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
    groups, blocks = batch * kv_heads, plan.width // KEY_BLOCK
    # Grouped-query layout: the query heads sharing a KV head are stacked along rows.
    q = F.pad(query, (0, 0, 0, plan.q_pad)).reshape(groups, -1, dim)  # (G, rows, D)
    k_blocks = _compact(key, plan).view(groups, blocks, KEY_BLOCK, dim).transpose(0, 1)
    v_blocks = _compact(value, plan).view(groups, blocks, KEY_BLOCK, dim).transpose(0, 1)
    k_blocks, v_blocks = k_blocks.contiguous(), v_blocks.contiguous()  # (blocks, G, KB, D)
    scores = [  # (G, rows, KEY_BLOCK) each: fixed shapes, so fixed GEMM kernels
        (torch.bmm(q, k_blocks[j].transpose(1, 2)) * scaling).masked_fill_(plan.dropped[j], -inf)
        for j in range(blocks)
    ]
    top = scores[0].amax(-1, keepdim=True)
    for s in scores[1:]:
        top = torch.maximum(top, s.amax(-1, keepdim=True))  # max is exact in any order
    top = top.masked_fill_(torch.isinf(top), 0.0)  # rows with no key at all
    total = torch.zeros_like(top)  # (G, rows, 1)
    out = q.new_zeros(q.shape)
    for j, s in enumerate(scores):  # sequential over blocks: a fixed order
        p = torch.exp(s - top)
        total = total + p.sum(-1, keepdim=True)
        out = out + torch.bmm(p, v_blocks[j])
    out = out / total.masked_fill_(total == 0, 1.0)
    out = out.view(batch, heads, q_len + plan.q_pad, dim)[:, :, :q_len]
    return out.transpose(1, 2).contiguous()


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
