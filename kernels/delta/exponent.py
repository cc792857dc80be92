"""`exponent_nibble`: the nibble codec with a float tensor's elements grouped by exponent.

Whether an RL step moves a bf16 weight, and by how many ulps, hangs on its magnitude: the
update is about the rate whatever the weight, and an ulp grows with the exponent, so small
weights move by several ulps and large ones seldom. `nibble` codes the mix with one Huffman
table per block of bytes; grouped by exponent, each group's d's have tight statistics of their
own, and one zstd frame per group codes them near that group's entropy. On the bootstrap's
bfloat16 versions at 3e-4 the groups' streams came to 1.55-1.72x smaller than `nibble`'s.

Self-inverse, as the sparse codec's classes are: an element whose exponent differs between
base and target (a change that carried across a power of two: a "crosser") is coded by
position with its whole d and left out of every group, so a decoder holding either end finds
the same groups with the same members. A group is one exponent value with at least `MIN_GROUP`
elements; the rarer exponents pool into one last group. Within a group the d's are `nibble`'s
symbols (d + 8 for |d| <= 7, 0 an escape), two to a byte (the group's first half in the low
nibbles), in element order; escapes as in `nibble`, by position over the whole tensor.

Streams: crosser gaps (byte symbols, uint64 overflows), crosser d's; escape gaps (symbols,
overflows), escape remainders (d + 8); then one packed-symbol stream per group, by increasing
exponent, the pooled group last. Decoding sorts the live exponents once (numpy's stable sort:
a radix sort for 16-bit keys) and scatters each group's d's back: slower to apply than
`nibble`'s contiguous adds, so the encoder keeps it only where it is clearly smaller.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kernels.delta.nibble import (
    BIAS,
    compress_symbols,
    nibble_symbols,
    pack_symbols,
    unpack_symbols,
)
from kernels.delta.streams import (
    MANTISSA_BITS,
    CorruptStreamError,
    compress,
    decompress,
    gaps_to_symbols,
    magnitude_mask,
    symbols_to_ordinals,
    xxh3_hex,
)

MIN_GROUP = 4096  # elements: a smaller exponent group costs more in frame headers than it saves
FIXED_STREAMS = 6


MISFIT = "misfit"  # the result hash of streams that do not fit the live tensor's groups


def applies_to(dtype: torch.dtype) -> bool:
    """Float dtypes: those with an exponent to group by."""
    return dtype in MANTISSA_BITS


def exponents(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """(n,) the exponent field of each element (the sign dropped), as int16 (at most 11 bits:
    numpy sorts 16-bit keys by radix)."""
    mask = magnitude_mask(dtype, bits.dtype.itemsize)
    assert mask is not None, "exponents of a dtype without them"
    return ((bits & bits.dtype.type(mask)) >> MANTISSA_BITS[dtype]).astype(np.int16)


def groups_of(exps: np.ndarray, crossers: np.ndarray) -> list[np.ndarray]:
    """Element positions per group, each in element order: one per exponent with at least
    `MIN_GROUP` members (increasing), then the rest pooled; crossers belong to none."""
    key = exps.copy()
    key[crossers] = -1
    order = np.argsort(key, kind="stable")  # a radix sort: members stay in element order
    counts = np.bincount(key.astype(np.int32) + 1)  # [0]: the crossers, [e + 1]: exponent e
    ends = np.cumsum(counts)  # exponent e's members: order[ends[e]:ends[e + 1]]
    groups: list[np.ndarray] = []
    pooled: list[np.ndarray] = []
    for value in np.flatnonzero(counts[1:]).tolist():
        members = order[ends[value]:ends[value + 1]]
        (groups if members.size >= MIN_GROUP else pooled).append(members)
    if pooled:
        groups.append(np.sort(np.concatenate(pooled)))
    return groups


def encode_exponent_nibble(base: np.ndarray, diff: np.ndarray, dtype: torch.dtype,
                           level: int, threads: int) -> list[bytes]:
    """Streams for the wrapped differences `diff` (n,) uint of the tensor at `base` (n,)."""
    exps = exponents(base, dtype)
    crossers = np.flatnonzero(exps != exponents(base + diff, dtype))
    symbols, small = nibble_symbols(diff)
    grouped = np.ones(diff.size, bool)
    grouped[crossers] = False
    escaped = np.flatnonzero(~small & grouped)
    remainders = diff[escaped] + diff.dtype.type(BIAS)
    streams = [*(compress(p, level, threads) for p in gaps_to_symbols(crossers)),
               compress(diff[crossers], level, threads),
               *(compress(p, level, threads) for p in gaps_to_symbols(escaped)),
               compress(remainders, level, threads)]
    return streams + [compress_symbols(pack_symbols(symbols[members]), threads)
                      for members in groups_of(exps, crossers)]


def decode_exponent_nibble(frames: Sequence[memoryview], live: np.ndarray, dtype: torch.dtype,
                           backward: bool) -> tuple[np.ndarray, str, str]:
    """(the new bit patterns, xxh3 of `live`, xxh3 of the result). Raises
    `CorruptStreamError` for streams that fit no tensor. Streams that do not fit the groups
    `live` makes mean it is neither end of the delta (or a group's stream is corrupt): `live`
    unchanged, its hash, and `MISFIT` for the result, which no tensor hashes to, so the
    caller's hash checks refuse it as the one or the other."""
    if len(frames) < FIXED_STREAMS:
        raise CorruptStreamError("exponent_nibble codec: too few streams")
    crossers = _positions(frames[0], frames[1], live.size)
    crossed = decompress(frames[2], live.dtype)
    escaped = _positions(frames[3], frames[4], live.size)
    remainders = decompress(frames[5], live.dtype)
    if crossed.size != crossers.size or remainders.size != escaped.size:
        raise CorruptStreamError("exponent_nibble codec: streams of different lengths")
    groups = groups_of(exponents(live, dtype), crossers)
    if len(frames) != FIXED_STREAMS + len(groups):
        return _misfit(live)
    d = np.zeros(live.size, live.dtype)
    for members, frame in zip(groups, frames[FIXED_STREAMS:], strict=True):
        packed = decompress(frame, np.uint8)
        if packed.size != (members.size + 1) // 2:
            return _misfit(live)
        d[members] = unpack_symbols(packed, members.size)
    d -= d.dtype.type(BIAS)
    d[escaped] += remainders  # an escape's symbol is 0: -8 + (d + 8)
    d[crossers] = crossed
    result = live - d if backward else live + d
    return result, xxh3_hex(live), xxh3_hex(result)


def _misfit(live: np.ndarray) -> tuple[np.ndarray, str, str]:
    return live.copy(), xxh3_hex(live), MISFIT


def _positions(symbols: memoryview, overflows: memoryview, size: int) -> np.ndarray:
    positions = symbols_to_ordinals(decompress(symbols, np.uint8),
                                    decompress(overflows, np.uint64))
    if positions.size and not (0 <= positions[0] and positions[-1] < size
                               and (np.diff(positions) > 0).all()):
        raise CorruptStreamError("exponent_nibble codec: positions outside the tensor")
    return positions
