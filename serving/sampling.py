"""Token sampling from a batch of logits, returning each sampled token's logprob.

One call samples every row of a decode step (no per-row tensor work in the engine's loop).
Each row draws its one uniform number from its own seeded generator and inverts its CDF, so
what a request samples depends on its seed and its logits alone, never on its batch.

The logprob is taken under the distribution the token was drawn from after temperature
scaling (what the trainer recomputes as log_softmax(logits / T)); nucleus truncation decides
which tokens may be drawn but does not renormalize the reported logprob; the nucleus always
holds the most likely token, however small `top_p` (its limit as top_p -> 0 is greedy). Greedy
decoding (temperature 0) takes the argmax and reports the raw log_softmax.

A row with a grammar (constrained decoding, serving/grammar.py) samples from its logits with
every token the grammar rejects at -inf: its distribution, and so the logprob it reports, is
the one renormalized over the allowed tokens, which is what was actually sampled from (a
token the grammar forces has logprob 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serving.grammar import TokenGrammar, mask_rejected


@dataclass(frozen=True)
class RowSampling:
    """How one row samples: its temperature, nucleus and generator."""

    temperature: float
    top_p: float
    generator: torch.Generator
    grammar: TokenGrammar | None = None  # the only tokens it may sample are the grammar's


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSampling]
                ) -> tuple[list[int], list[float], torch.Tensor]:
    """Sample one token per row of `logits` (B, V): (tokens, their logprobs, logprobs (B, V))."""
    logits = mask_rejected(logits.float(), [r.grammar for r in rows])
    temperature = torch.tensor([[r.temperature if r.temperature > 0 else 1.0] for r in rows])
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    tokens = logits.argmax(dim=-1)  # the greedy rows' answer
    sampled = [b for b, r in enumerate(rows) if r.temperature > 0]
    if sampled:
        index = torch.tensor(sampled)
        probs = logprobs.index_select(0, index).exp()
        nucleus = [i for i, b in enumerate(sampled) if rows[b].top_p < 1.0]
        if nucleus:
            probs[nucleus] = _nucleus(probs[nucleus], [rows[sampled[i]].top_p for i in nucleus])
        cdf = probs.cumsum(dim=-1)
        draws = torch.cat([torch.rand(1, generator=rows[b].generator) for b in sampled])
        picked = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(1), right=True)
        tokens[index] = picked.squeeze(1).clamp(max=logits.shape[-1] - 1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens.tolist(), chosen.tolist(), logprobs


def _nucleus(probs: torch.Tensor, top_p: Sequence[float]) -> torch.Tensor:
    """`probs` (N, V) with every token outside each row's top-p nucleus zeroed."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    limit = torch.tensor(top_p).unsqueeze(1)
    keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < limit
    keep[:, 0] = True  # a top_p below float32's resolution would keep nothing
    mask = torch.zeros_like(keep).scatter_(1, order, keep)
    return torch.where(mask, probs, torch.zeros_like(probs))


def top_alternatives(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, indices = torch.topk(logprobs, k)
    # a token a grammar masked out (-inf) is no alternative
    return [(int(i), float(v)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)
            if v != float("-inf")]
