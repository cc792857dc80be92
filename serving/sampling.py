"""Token sampling from logits, returning the sampled token's logprob.

The logprob is taken under the distribution the token was drawn from after temperature
scaling (what the trainer recomputes as log_softmax(logits / T)); nucleus truncation decides
which tokens may be drawn but does not renormalize the reported logprob; the nucleus always
holds the most likely token, however small `top_p` (its limit as top_p -> 0 is greedy). Greedy
decoding (temperature 0) reports the raw log_softmax.
"""

from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, *, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[int, float, torch.Tensor]:
    """Sample one token from `logits` (V,); return (token, logprob, logprobs (V,))."""
    logits = logits.float()
    if temperature <= 0.0:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        return token, float(logprobs[token]), logprobs
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    probs = logprobs.exp()
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        keep[0] = True  # a top_p below float32's resolution would keep nothing
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token]), logprobs


def top_alternatives(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, indices = torch.topk(logprobs, k)
    return [(int(i), float(v)) for i, v in zip(indices, values, strict=True)]
