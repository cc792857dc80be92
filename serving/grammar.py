"""Constrained decoding for the torch engine: a request's xgrammar structural tag
(`GenerationRequest.structural_tag`) as a token mask per decode step.

`Grammars` compiles tags for one tokenizer (each distinct tag once, in xgrammar's cache: an
agent sends the same tools every turn) and opens a `TokenGrammar` per request, which follows
the tokens sampled; `mask_rejected` puts a decode step's constrained rows' rejected tokens at
-inf, all rows in one batched fill. The stop tokens are allowed exactly where the grammar is
complete, so a constrained generation ends with its last call. xgrammar is imported on the
first constrained request only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import Any

import torch

from serving.engine import EngineError


class TokenGrammar:
    """One request's grammar state."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher  # xgrammar.GrammarMatcher

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise EngineError(f"token {token} breaks the request's grammar")

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_terminated())


def mask_rejected(logits: torch.Tensor, grammars: Sequence[TokenGrammar | None]
                  ) -> torch.Tensor:
    """`logits` (B, V) float32 with every token that row b's grammar rejects next at -inf, as
    a copy; rows without a grammar (None) as they were, and `logits` itself when none has one.
    The rows' bitmasks are filled in one call (xgrammar's batch matcher, over its threads) and
    applied in one, so a step's cost does not grow with Python work per row."""
    rows = [b for b, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    import xgrammar

    vocab = logits.shape[-1]
    bitmask = xgrammar.allocate_token_bitmask(len(grammars), vocab)
    _batch_matcher().batch_fill_next_token_bitmask(
        [grammars[b].matcher for b in rows], bitmask, indices=rows)  # type: ignore[union-attr]
    masked = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    xgrammar.apply_token_bitmask_inplace(masked, bitmask, vocab_size=vocab, indices=rows)
    return masked


_per_thread = threading.local()


def _batch_matcher() -> Any:
    """This thread's batch matcher: each engine samples on a thread of its own, so a matcher
    (and its thread pool) is never called from two engines at once."""
    matcher = getattr(_per_thread, "matcher", None)
    if matcher is None:
        import xgrammar

        matcher = _per_thread.matcher = xgrammar.BatchGrammarMatcher()
    return matcher


class Grammars:
    """Structural tags compiled for one tokenizer and vocabulary (xgrammar's compiler keeps
    each compiled tag in its own cache)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._stop_ids = sorted(stop_ids)

    @cached_property
    def _compiler(self) -> Any:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(
            self._tokenizer, vocab_size=self._vocab, stop_token_ids=self._stop_ids)
        return xgrammar.GrammarCompiler(info, cache_enabled=True)

    def open(self, structural_tag: str) -> TokenGrammar:
        import xgrammar

        try:
            compiled = self._compiler.compile_structural_tag(structural_tag)
        except Exception as exc:  # xgrammar's errors have no common base
            raise EngineError(f"cannot compile the structural tag: {exc}") from exc
        return TokenGrammar(xgrammar.GrammarMatcher(compiled))
