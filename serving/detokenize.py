"""Incremental detokenization with stop strings, for streaming text out of token ids.

Byte-level BPE can split one character over several tokens, so text is decoded over a short
window and released only when it no longer ends in a partial character (the offsets scheme
vLLM and TGI use). Text that could still become a stop string is held back, so a stream never
shows part of a stop string; the stop string itself is never part of the output (OpenAI).
A tracker with no stop strings whose caller takes only the whole text (`incremental=False`:
`Engine.generate`, the rollouts' path) decodes once, at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextTracker:
    """Turns one generation's tokens into text deltas; `stopped` once a stop string appears."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), *,
                 incremental: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._incremental = incremental or bool(self._stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # all decoded text so far (truncated at a stop string once stopped)
        self._emitted = 0
        self.stopped = False

    def _decode(self, tokens: list[int]) -> str:
        return str(self._tokenizer.decode(tokens, skip_special_tokens=True))

    def push(self, token: int) -> str:
        """Add one token; return the text that may be shown now."""
        self._tokens.append(token)
        if not self._incremental:
            return ""
        prefix = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
            self._append(new)
        if self.stopped:
            return self._release(len(self.text))
        return self._release(len(self.text) - self._holdback)

    def _append(self, new: str) -> None:
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def finish(self) -> str:
        """The rest of the text (call once, when the generation ends)."""
        if not self.stopped and self._read_offset < len(self._tokens):
            full = self._decode(self._tokens[self._prefix_offset:])
            prefix = self._decode(self._tokens[self._prefix_offset:self._read_offset])
            self._append(full[len(prefix):])
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.text[self._emitted:upto]
        self._emitted = upto
        return out
