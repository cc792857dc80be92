"""Constrained decoding for the torch engine: a request's xgrammar structural tag
(`GenerationRequest.structural_tag`) as a token mask per decode step.

`Grammars` compiles tags for one tokenizer (each distinct tag once, in xgrammar's cache: an
agent sends the same tools every turn) and opens a `TokenGrammar` per request, which says
which tokens may come next and follows the tokens sampled. The stop tokens are allowed
exactly where the grammar is complete, so a constrained generation ends with its last call.
xgrammar is imported on the first constrained request only.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property
from typing import Any

import numpy as np
import torch

from serving.engine import EngineError


class TokenGrammar:
    """One request's grammar state."""

    def __init__(self, matcher: Any, bitmask: torch.Tensor, vocab_size: int) -> None:
        self._matcher = matcher
        self._bitmask = bitmask  # (1, ceil(V / 32)) int32, refilled each step
        self._vocab = vocab_size

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens the grammar accepts next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        # bit j of int32 word i is token 32 i + j: little-endian bytes, low bit first
        bits = np.unpackbits(self._bitmask[0].numpy().view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self._vocab]).bool()

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise EngineError(f"token {token} breaks the request's grammar")

    @property
    def done(self) -> bool:
        return bool(self._matcher.is_terminated())


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
        return TokenGrammar(xgrammar.GrammarMatcher(compiled),
                            xgrammar.allocate_token_bitmask(1, self._vocab), self._vocab)
