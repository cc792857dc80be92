"""Prefix caching: reuse the keys/values of token sequences the engine computed recently.

A multi-turn episode resends its whole conversation every turn, and a GRPO group sends the
same prompt G times, so most prefill tokens were fed through the model moments earlier. The
engine keeps the per-layer keys/values (and MoE routes) of recent sequences here; a new prompt
that starts with one of them prefills only the tokens after the shared prefix.

Lookup walks the prompt in blocks of `BLOCK` tokens through a chain of block hashes (as vLLM's
automatic prefix caching does), then extends the match token by token against the entry it
found, and verifies it, so a hash collision can cost a miss but never a wrong prefix. Entries
are evicted least recently used first, by a budget of cached tokens.

The cached keys/values were computed in other forward passes (another prompt length, one
token at a time while decoding), so a prompt's logits can differ from a full prefill's within
float tolerance: do not combine with bitwise batch invariance. Cached values depend on the
weights: the owner must `clear()` on every weight change.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

BLOCK = 16


def repeat_waves(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The indices of `prompts` in prefill waves: each prompt's first copy, then its repeats
    (a GRPO group's G copies), which wait for the first copy's prefill and then reuse all of
    it but the last token. Empty waves are left out."""
    first: list[int] = []
    repeats: list[int] = []
    seen: set[tuple[int, ...]] = set()
    for i, prompt in enumerate(prompts):
        key = tuple(prompt)
        (repeats if key in seen else first).append(i)
        seen.add(key)
    return [wave for wave in (first, repeats) if wave]


@dataclass(eq=False)
class PrefixEntry:
    tokens: np.ndarray  # (T,) int64
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (1, H, T, D)
    routes: torch.Tensor | None  # (T, L, K): the experts each token was routed to
    hashes: list[int] = field(default_factory=list)  # of its block-aligned prefixes


@dataclass(frozen=True)
class PrefixHit:
    """The first `length` tokens of a prompt, cached."""

    length: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (1, H, length, D): views, read-only
    routes: torch.Tensor | None  # (length, L, K)


def _block_hashes(tokens: np.ndarray, blocks: int) -> Iterator[int]:
    """Chained hashes of tokens[:BLOCK], tokens[:2 * BLOCK], … (`blocks` of them), lazily: a
    lookup stops hashing at its first miss."""
    h = 0
    for b in range(blocks):
        h = hash((h, tokens[b * BLOCK:(b + 1) * BLOCK].tobytes()))
        yield h


class PrefixCache:
    """Recently computed sequences' keys/values, up to `max_tokens` tokens in all (LRU)."""

    def __init__(self, max_tokens: int, *, min_reuse: int = BLOCK) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be positive")
        self.max_tokens = max_tokens
        self.min_reuse = min_reuse
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # LRU first
        self._by_hash: dict[int, PrefixEntry] = {}
        self.tokens = 0
        self.lookups = self.hits = self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> PrefixHit | None:
        """The longest cached prefix of `prompt`, leaving at least its last token to feed
        (its logits are what the engine samples from); None below `min_reuse` tokens."""
        self.lookups += 1
        tokens = np.asarray(prompt, dtype=np.int64)
        limit = len(tokens) - 1
        entry = None
        for h in _block_hashes(tokens, limit // BLOCK):
            found = self._by_hash.get(h)
            if found is None:
                break
            entry = found
        if entry is None:
            return None
        n = min(limit, len(entry.tokens))
        same = entry.tokens[:n] == tokens[:n]
        length = n if same.all() else int(same.argmin())
        if length < self.min_reuse:
            return None
        self._entries.move_to_end(id(entry))
        self.hits += 1
        self.reused_tokens += length
        return PrefixHit(length, [(k[:, :, :length], v[:, :, :length]) for k, v in entry.kv],
                         entry.routes[:length] if entry.routes is not None else None)

    def insert(self, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]],
               routes: torch.Tensor | None) -> None:
        """Cache `tokens`' keys/values (per layer (1, H, T, D), not modified afterwards)."""
        if len(tokens) < self.min_reuse or len(tokens) > self.max_tokens:
            return
        entry = PrefixEntry(np.asarray(tokens, dtype=np.int64), kv, routes)
        entry.hashes = list(_block_hashes(entry.tokens, len(tokens) // BLOCK))
        for h in entry.hashes:
            self._by_hash[h] = entry  # the newest entry answers for a shared prefix
        self._entries[id(entry)] = entry
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            self._evict()

    def clear(self) -> None:
        self._entries.clear()
        self._by_hash.clear()
        self.tokens = 0

    def _evict(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.tokens -= len(entry.tokens)
        for h in entry.hashes:
            if self._by_hash.get(h) is entry:
                del self._by_hash[h]
