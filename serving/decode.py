"""One decode step of the torch engine over its `PaddedKVBatch`: a lean forward for the
families Flywheel builds and tests (Qwen3-MoE, Qwen3, Llama, Mistral, Mixtral, OLMoE), or the
model's own Hugging Face forward for anything else.

A decode step feeds one token per row. Hugging Face's forward is built for any shape: per call
it builds a 4-D causal mask, RoPE tables, output dataclasses and a `DynamicCache` that
concatenates every layer's keys/values into new tensors. At the default model's size that
bookkeeping, not arithmetic, is most of a step. `LeanDecoder` runs the same layers on the
same parameters (the model's projection modules, its norms' and routers' weights: a swap in
place is seen at once) with what a one-token step needs: RoPE rows from a table, keys/values
written into the batch's store in place, grouped-query attention as two batched matmuls over
the live columns, and the feed-forward half: a dense MLP's three projections, or a MoE layer's
router math inline and the top-k experts computed per token (few tokens) or as one grouped GEMM
per projection (many). The families differ in three places, each read from the model: the
query/key norm (per head in Qwen3, over the whole projection in OLMoE, none in Llama, Mistral
and Mixtral), dense or expert layers, and whether the router renormalizes its top-k. It returns
each row's logits and the experts every MoE layer chose (None for a dense model), as the route
recorder would have. `compile` puts the steps of a few rows through `torch.compile`, where
per-op overhead is all their cost.

`mixed` is the same step with requests joining: their prompt tokens (past any cached prefix) go
through every projection, router and expert GEMM together with the rows' new tokens, attention
apart (each prompt causal over itself). With many clients a request joins at almost every
step, and a separate prefill forward would stream every weight a second time; fused, a step
that admits reads them once.

Logits agree with Hugging Face's forward to float tolerance, not bitwise (other kernels, other
summation order), so the batch-invariant mode keeps the model's own forward
(`kernels.batch_invariant` swaps its modules for invariant ones): `lean_decoder` returns None
for it, for a family outside the list, and for a configuration the step does not compute
(projection biases, a sliding window shorter than the context, RoPE whose table depends on the
sequence length, OLMoE's `clip_qkv`).

    decoder = lean_decoder(model)        # None: use the model's forward
    logits, routes = decode(model, decoder, batch, tokens, recorder)
    step = decoder.mixed(tokens, batch, [Joining(prompt), Joining(rest, cached_kv)])
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from serving.batching import KV, PaddedKVBatch
from serving.experts import route, run_experts
from serving.onednn import OneDnnMode, OneDnnWeights

log = logging.getLogger(__name__)

# model_type -> how its attention normalizes queries and keys: per head after the projection is
# split into heads, over the whole projection before, or not at all
QK_NORM: dict[str, Literal["head", "projection", None]] = {
    "qwen3_moe": "head", "qwen3": "head", "olmoe": "projection",
    "llama": None, "mistral": None, "mixtral": None}
# RoPE types whose table is fixed at load (`rotary_emb.inv_freq`, `attention_scaling`); the
# others ("dynamic", "longrope") change with the sequence length
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def lean_decoder(model: Any, *, batch_invariant: bool = False,
                 onednn: OneDnnMode = "auto") -> LeanDecoder | None:
    """The lean decode step for `model`, or None where it does not apply. `onednn`: whether
    its GEMMs use oneDNN copies of the weights (`OneDnnWeights.for_model`)."""
    config = model.config
    if batch_invariant or getattr(config, "model_type", None) not in QK_NORM:
        return None
    rope = getattr(config, "rope_parameters", None) or {}
    window = getattr(config, "sliding_window", None)
    if (rope.get("rope_type", "default") not in STATIC_ROPE
            or getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
            or (window is not None and window < config.max_position_embeddings)
            or getattr(config, "clip_qkv", None) is not None):
        return None
    return LeanDecoder(model, onednn=onednn)


def decode(model: Any, decoder: LeanDecoder | None, batch: PaddedKVBatch,
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


@dataclass(frozen=True)
class Joining:
    """A request that joins the batch in a mixed step: its prompt tokens past the cached
    prefix, and that prefix's keys/values (per layer (1, Hkv, c, D); None: nothing cached)."""

    tokens: list[int]
    past: KV | None = None

    @property
    def past_length(self) -> int:
        return 0 if self.past is None else int(self.past[0][0].shape[2])


@dataclass(frozen=True)
class MixedStep:
    logits: torch.Tensor  # (B + N, V): the batch's rows, then each joining request's last token
    routes: torch.Tensor | None  # (B, L, K) int16: the batch rows' experts
    joined_routes: list[torch.Tensor | None]  # per joining request (n, L, K): its fed tokens'
    joined_kv: list[KV]  # per joining request, per layer (1, Hkv, c + n, D): its whole prompt


class LeanDecoder:
    """The one-token forward of a transformers causal LM of one of `QK_NORM`'s families (see
    module doc)."""

    def __init__(self, model: Any, *, onednn: OneDnnMode = "auto") -> None:
        self.model = model
        config = model.config
        self.layers = list(model.model.layers)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        self.qk_norm = QK_NORM[config.model_type]
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
        # the fewest rows whose (token, expert) pairs outnumber the experts: grouped GEMMs (a
        # dense model: the rows from which a step is GEMMs rather than per-op overhead, as for
        # the default MoE)
        self.grouped_from = (experts // config.num_experts_per_tok if experts else 4) + 1
        self._compiled = self.forward  # `compile` replaces it
        self.onednn = OneDnnWeights.for_model(model, onednn)
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
                kv: KV) -> tuple[torch.Tensor, torch.Tensor | None]:
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        bias = _bias(mask, cos.dtype)
        h = self.model.model.embed_tokens(tokens)  # (B, H)
        routes = []
        for layer, (keys, values) in zip(self.layers, kv, strict=True):
            attn = layer.self_attn
            q, k, v = self._qkv(layer, _norm(layer.input_layernorm, h), cos, sin)
            h = h + self._project(attn.o_proj,
                                  self._decode_attention(attn, q, k, v, keys, values, bias))
            h, chosen = self._mlp(layer, h)
            if chosen is not None:
                routes.append(chosen)
        logits = self._project(self.model.lm_head, _norm(self.model.model.norm, h))
        return logits, (torch.stack(routes, dim=1) if routes else None)

    def mixed(self, tokens: list[int], batch: PaddedKVBatch, joining: Sequence[Joining]
              ) -> MixedStep:
        """One forward that feeds each row of `batch` its next token (as `step` does, the
        batch may be empty) and each of `joining` its prompt tokens past its cached prefix:
        every token of both goes through each layer's projections, router and experts
        together, so a step that admits requests reads the weights once, not twice. Eager
        (its shapes vary with every prompt)."""
        device, rows = self.cos.device, len(tokens)
        fed = [len(j.tokens) for j in joining]
        past = [j.past_length for j in joining]
        positions = [torch.arange(c, c + n) for c, n in zip(past, fed, strict=True)]
        ids = tokens + [t for j in joining for t in j.tokens]
        kv: KV = []
        bias = torch.zeros(0)  # replaced when the batch has rows (no rows: no decode attention)
        if rows:
            mask, _ = batch.step_inputs()
            positions.insert(0, batch.positions)
            bias, kv = _bias(mask.to(device), self.cos.dtype), batch.step_kv()
        index = torch.cat(positions).to(device)
        cos, sin = self.cos[index].unsqueeze(1), self.sin[index].unsqueeze(1)
        h = self.model.model.embed_tokens(torch.tensor(ids, device=device))  # (B + T, H)
        joined: list[KV] = [[] for _ in joining]
        routes = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(layer, _norm(layer.input_layernorm, h), cos, sin)
            out = []
            if rows:
                keys, values = kv[i]
                out.append(self._decode_attention(attn, q[:rows], k[:rows], v[:rows], keys,
                                                  values, bias))
            start = rows
            for j, request in enumerate(joining):
                end = start + fed[j]
                attended, layer_kv = self._prompt_attention(
                    attn, q[start:end], k[start:end], v[start:end],
                    request.past[i] if request.past is not None else None)
                out.append(attended)
                joined[j].append(layer_kv)
                start = end
            h = h + self._project(attn.o_proj, torch.cat(out))
            h, chosen = self._mlp(layer, h)
            if chosen is not None:
                routes.append(chosen)
        last = torch.tensor(fed, device=device).cumsum(0) + rows - 1  # each prompt's last token
        keep = torch.cat([torch.arange(rows, device=device), last])
        logits = self._project(self.model.lm_head, _norm(self.model.model.norm, h[keep]))
        if not routes:  # no MoE layer
            return MixedStep(logits, None, [None] * len(joining), joined)
        routed = torch.stack(routes, dim=1).to("cpu", torch.int16)  # (B + T, L, K)
        return MixedStep(logits, routed[:rows], list(routed[rows:].split(fed)), joined)

    def _qkv(self, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's query (T, Hq, D), key and value (T, Hkv, D), RoPE applied."""
        attn, t, d = layer.self_attn, x.shape[0], self.head_dim
        q, k = self._project(attn.q_proj, x), self._project(attn.k_proj, x)
        if self.qk_norm == "projection":
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.view(t, self.heads, d), k.view(t, self.kv_heads, d)
        if self.qk_norm == "head":
            q, k = attn.q_norm(q), attn.k_norm(k)
        return _rope(q, cos, sin), _rope(k, cos, sin), self._project(attn.v_proj, x).view(
            t, self.kv_heads, d)

    def _decode_attention(self, attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
                          ) -> torch.Tensor:
        """Self-attention of one new token per row over its row's keys/values
        (B, Hkv, S + 1, D), whose last column this writes: (B, Hq * D)."""
        rows, d = q.shape[0], self.head_dim
        keys[:, :, -1] = k
        values[:, :, -1] = v
        q = q.view(rows, self.kv_heads, self.heads // self.kv_heads, d)  # a group per kv head
        scores = torch.matmul(q, keys.transpose(-1, -2)) * attn.scaling + bias  # (B, Hkv, G, S)
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), values)
        return out.reshape(rows, self.heads * d)

    def _prompt_attention(self, attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          past: tuple[torch.Tensor, torch.Tensor] | None
                          ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Causal self-attention of one prompt's n new tokens (q (n, Hq, D), k and v
        (n, Hkv, D)) over its cached prefix (`past`, (1, Hkv, c, D) each) and themselves:
        (n, Hq * D), and the prompt's keys/values (1, Hkv, c + n, D)."""
        keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if past is not None:
            keys, values = torch.cat([past[0], keys], dim=2), torch.cat([past[1], values], dim=2)
        n, cached = q.shape[0], keys.shape[2] - q.shape[0]
        mask = None  # no prefix: plain causal
        if cached:  # query i (position cached + i) sees columns 0..cached + i
            mask = (torch.arange(cached + n, device=q.device)[None]
                    <= torch.arange(n, device=q.device)[:, None] + cached)
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values,
                                             attn_mask=mask, is_causal=mask is None,
                                             scale=attn.scaling, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(n, self.heads * self.head_dim), (keys, values)

    def _mlp(self, layer: Any, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's feed-forward half with its residual, and the experts each token chose
        ((T, K); None for a dense layer)."""
        x = _norm(layer.post_attention_layernorm, h)
        mlp = layer.mlp
        if not hasattr(mlp, "experts"):  # a dense model, or a MoE's dense layer (mlp_only_layers)
            gated = mlp.act_fn(self._project(mlp.gate_proj, x)) * self._project(mlp.up_proj, x)
            return h + self._project(mlp.down_proj, gated), None
        weights, experts = route(mlp.gate, x)  # (T, K) each
        return h + run_experts(mlp.experts, x, weights, experts, self.onednn), experts

    def _project(self, linear: Any, x: torch.Tensor) -> torch.Tensor:
        """`linear(x)` (a bias-free projection), on its oneDNN copy for a GEMM of many rows."""
        if self.onednn is not None and x.shape[0] >= self.grouped_from:
            return self.onednn.linear(linear.weight, x)
        return linear(x)

    def weights_changed(self) -> None:
        """The model's weights were written (a swap, a load): drop the copies made of them."""
        if self.onednn is not None:
            self.onednn.clear()


def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention bias (B, 1, 1, S) from a mask (B, S): 0 where 1, -inf where 0."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        mask == 0, float("-inf"))[:, None, None]


def _norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """A transformers RMSNorm module's math in one op (float32 inside, as it does)."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon)
    return normed.to(x.dtype) * norm.weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, H, D) with each row's (B, 1, D) cos/sin (rotate-half layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
