"""One decode step of the torch engine over its `PaddedKVBatch`: a lean forward for the
Qwen3-MoE family, or the model's own Hugging Face forward for everything else.

A decode step feeds one token per row. Hugging Face's forward is built for any shape: per call
it builds a 4-D causal mask, RoPE tables, output dataclasses and a `DynamicCache` that
concatenates every layer's keys/values into new tensors. At the default model's size that
bookkeeping, not arithmetic, is most of a step. `Qwen3MoeDecoder` runs the same layers on the
same parameters (the model's projection modules, its norms' and routers' weights: a swap in
place is seen at once) with what a one-token step needs: RoPE rows from a table, keys/values
written into the batch's store in place, grouped-query attention as two batched matmuls over
the live columns, the router's math inline, and the top-k experts computed per token (few
tokens) or as one grouped GEMM per projection (many). It returns each row's logits and the
experts every MoE layer chose, as the route recorder would have. `compile` puts the steps of a
few rows through `torch.compile`, where per-op overhead is all their cost.

Logits agree with Hugging Face's forward to float tolerance, not bitwise (other kernels, other
summation order), so the batch-invariant mode keeps the model's own forward
(`kernels.batch_invariant` swaps its modules for invariant ones): `lean_decoder` returns None
for it, and for any model outside the family.

    decoder = lean_decoder(model)        # None: use the model's forward
    logits, routes = decode(model, decoder, batch, tokens, recorder)
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.nn.functional as F

from serving.batching import PaddedKVBatch

log = logging.getLogger(__name__)


def lean_decoder(model: Any, *, batch_invariant: bool = False) -> Qwen3MoeDecoder | None:
    """The lean decode step for `model`, or None where it does not apply."""
    config = model.config
    if batch_invariant or getattr(config, "model_type", None) != "qwen3_moe":
        return None
    rope = getattr(config, "rope_parameters", None) or {}
    if (rope.get("rope_type", "default") != "default" or config.attention_bias
            or getattr(config, "sliding_window", None) is not None):
        return None
    return Qwen3MoeDecoder(model)


def decode(model: Any, decoder: Qwen3MoeDecoder | None, batch: PaddedKVBatch,
           tokens: list[int], recorder: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Feed each row its next token: (logits (B, V), routes (B, L, K) int16 or None). The
    batch's store holds the step's keys/values afterwards; the caller `advance`s it."""
    if decoder is not None:
        return decoder.step(tokens, batch)
    mask, positions = batch.step_inputs()
    cache = batch.dynamic_cache()
    out = model(input_ids=torch.tensor([[t] for t in tokens]), attention_mask=mask,
                position_ids=positions, past_key_values=cache, use_cache=True)
    batch.commit(cache)
    routes = recorder.pop_step().routes[:, 0] if recorder is not None else None  # (B, L, K)
    return out.logits[:, -1], routes


class Qwen3MoeDecoder:
    """The one-token forward of a transformers Qwen3-MoE causal LM (see module doc)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        config = model.config
        self.layers = list(model.model.layers)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        # the fewest rows whose (token, expert) pairs outnumber the experts: grouped GEMMs
        self.grouped_from = config.num_experts // config.num_experts_per_tok + 1
        self._compiled = self.forward  # `compile` replaces it
        rotary = model.model.rotary_emb
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32,
                                 device=rotary.inv_freq.device)
        freqs = positions[:, None] * rotary.inv_freq.float()[None]  # as rotary_emb computes
        table = torch.cat([freqs, freqs], dim=-1)
        dtype = model.lm_head.weight.dtype
        self.cos = (table.cos() * rotary.attention_scaling).to(dtype)  # (P, D)
        self.sin = (table.sin() * rotary.attention_scaling).to(dtype)

    def compile(self) -> bool:
        """Compile `forward` for steps of fewer than `grouped_from` rows (torch.compile,
        dynamic shapes; one graph for one row, one for more) and run each once, so that no
        request waits for a compilation. Such steps are all per-op overhead, which compiling
        removes; a bigger step's time is its GEMMs (and its grouped GEMM's group sizes depend
        on the data, which would break the graph), so it stays eager. False, and eager kept,
        where compiling fails (no C++ compiler, say)."""
        compiled = torch.compile(self.forward, dynamic=True)
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                for rows in sorted({1, min(2, self.grouped_from - 1)}):
                    self._warm(compiled, rows)
        except Exception:
            log.warning("torch.compile of the decode step failed; it runs eagerly",
                        exc_info=True)
            return False
        self._compiled = compiled
        log.info("decode step compiled in %.1fs", time.perf_counter() - started)
        return True

    def _warm(self, forward: Any, rows: int, width: int = 8) -> None:
        """One step of `rows` rows over `width` columns of zeros, laid out as a batch's store."""
        device = self.cos.device

        def column_view() -> torch.Tensor:  # live columns and the step's, spare ones after
            store = torch.zeros(rows, self.kv_heads, width + 64, self.head_dim, device=device,
                                dtype=self.cos.dtype)
            return store[:, :, :width + 1]

        forward(torch.zeros(rows, dtype=torch.long, device=device),
                torch.full((rows,), width, device=device),
                torch.ones(rows, width + 1, dtype=torch.long, device=device),
                [(column_view(), column_view()) for _ in self.layers])

    def step(self, tokens: list[int], batch: PaddedKVBatch
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = self.cos.device
        mask, _ = batch.step_inputs()  # (B, S + 1)
        forward = self._compiled if len(tokens) < self.grouped_from else self.forward
        logits, routes = forward(torch.tensor(tokens, device=device),
                                      batch.positions.to(device), mask.to(device),
                                      batch.step_kv())
        return logits, (routes.to("cpu", torch.int16) if routes is not None else None)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                kv: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        bias = torch.zeros(mask.shape, dtype=cos.dtype, device=mask.device).masked_fill_(
            mask == 0, float("-inf"))[:, None, None]  # (B, 1, 1, S + 1)
        h = self.model.model.embed_tokens(tokens)  # (B, H)
        routes = []
        for layer, (keys, values) in zip(self.layers, kv, strict=True):
            h = h + self._attention(layer, _norm(layer.input_layernorm, h), keys, values,
                                    cos, sin, bias)
            x = _norm(layer.post_attention_layernorm, h)
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                weights, experts = _route(mlp.gate, x)  # (B, K) each
                h = h + _experts(mlp.experts, x, weights, experts)
                routes.append(experts)
            else:  # a dense layer (mlp_only_layers)
                h = h + mlp(x)
        logits = self.model.lm_head(_norm(self.model.model.norm, h))
        return logits, (torch.stack(routes, dim=1) if routes else None)

    def _attention(self, layer: Any, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Self-attention of one new token per row over its row's keys/values (B, Hkv, S + 1, D),
        whose last column this step writes."""
        attn, rows, d = layer.self_attn, x.shape[0], self.head_dim
        q = _rope(attn.q_norm(attn.q_proj(x).view(rows, self.heads, d)), cos, sin)
        keys[:, :, -1] = _rope(attn.k_norm(attn.k_proj(x).view(rows, self.kv_heads, d)), cos, sin)
        values[:, :, -1] = attn.v_proj(x).view(rows, self.kv_heads, d)
        q = q.view(rows, self.kv_heads, self.heads // self.kv_heads, d)  # a group per kv head
        scores = torch.matmul(q, keys.transpose(-1, -2)) * attn.scaling + bias  # (B, Hkv, G, S)
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), values)
        return attn.o_proj(out.reshape(rows, self.heads * d))


def _norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """A transformers RMSNorm module's math in one op (float32 inside, as it does)."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon)
    return normed.to(x.dtype) * norm.weight


def _route(router: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers top-k router's (weights, experts), both (B, K), with its math: softmax
    over every expert in float32, top-k, renormalized if it does. Its module is not called, so
    route-capture hooks (which the recorder fills per model call) stay out of a decode step."""
    probs = torch.softmax(F.linear(x, router.weight), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, router.top_k, dim=-1)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, H, D) with each row's (B, 1, D) cos/sin (rotate-half layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _experts(experts: Any, x: torch.Tensor, weights: torch.Tensor,
             chosen: torch.Tensor) -> torch.Tensor:
    """The weighted sum of each row's top-k experts: (B, H) from x (B, H), weights and
    chosen (B, K). Few tokens: each (token, expert) pair as one matrix-vector product on that
    expert's weights; many: tokens sorted by expert, one grouped GEMM per projection."""
    rows, k = chosen.shape
    gate_up, down = experts.gate_up_proj, experts.down_proj  # (E, 2I, H), (E, H, I)
    flat = chosen.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)  # (B*K, H), pair order
    if rows * k <= gate_up.shape[0]:  # gathering the pairs' weights costs less than a GEMM
        # (Qwen3MoeDecoder.grouped_from: the first row count past this)
        gate, up = torch.bmm(gate_up[flat], xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        out = torch.bmm(down[flat], (experts.act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)
    else:
        out = _grouped(experts, xs, flat)
    return (out.view(rows, k, -1) * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)


def _grouped(experts: Any, xs: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Each (token, expert) pair's expert output, (N, H) for xs (N, H) and experts flat (N,):
    pairs sorted by expert, one grouped GEMM per projection."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    order = flat.argsort(stable=True)
    ends = torch.bincount(flat, minlength=gate_up.shape[0]).cumsum(0).to(torch.int32)
    gate, up = F.grouped_mm(xs[order], gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    out = torch.empty_like(xs)
    out[order] = F.grouped_mm(experts.act_fn(gate) * up, down.transpose(1, 2), offs=ends)
    return out
