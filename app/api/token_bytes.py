"""What a token stands for in bytes: its text, its exact bytes, and a bound on how many bytes
any one token of a vocabulary covers.

For a byte-level BPE (GPT-2's scheme, which Qwen and the default model use) every character of
a vocabulary piece stands for one byte through a fixed table; other tokenizers are handled
through their decoded text.
"""

from __future__ import annotations

import functools
from typing import Any


def token_text(tokenizer: Any, token: int) -> str:
    return str(tokenizer.decode([token]))


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-in character -> the byte it stands for."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(extra)}


def token_bytes(tokenizer: Any, token: int, text: str) -> list[int]:
    """The token's exact bytes (a byte-level token may hold part of a UTF-8 character)."""
    piece = str(tokenizer.convert_ids_to_tokens(token))
    table = byte_decoder()
    if token not in tokenizer.all_special_ids and piece and all(c in table for c in piece):
        return [table[c] for c in piece]
    return list(text.encode())


@functools.lru_cache(maxsize=4)
def max_token_bytes(tokenizer: Any) -> int:
    """A bound on the UTF-8 bytes one token stands for: its longest vocabulary piece, at one
    byte a character for a byte-level BPE, else at 4."""
    pieces = tokenizer.get_vocab()
    table = byte_decoder()
    byte_level = all(c in table for piece in pieces for c in piece)
    return (1 if byte_level else 4) * max(len(piece) for piece in pieces)
