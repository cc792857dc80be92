"""Bit-pattern helpers of the delta codecs: views, hashes, zstd frames, magnitude classes,
and the byte-symbol streams (gaps and signed-byte values, with escapes) of the sparse codec.

Everything here is a pure function over numpy arrays; kernels/delta/codec.py composes them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
import xxhash
import zstandard

CHUNK = 1 << 18  # elements per decode step: keeps scratch and masks in cache
ESCAPE = 255  # gap byte that defers to the escape stream
VALUE_ESCAPE = 0x80  # int8 -128: value byte that defers to the escape stream
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


class CorruptStreamError(ValueError):
    """Decoded streams that do not fit the tensor (lengths, positions, counts)."""


def tensor_bits(tensor: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer view of a contiguous tensor's memory (writes go to the tensor)."""
    if not tensor.is_contiguous():
        raise ValueError("delta codecs need contiguous tensors")
    raw = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    width = tensor.element_size()
    return raw.view(UINT[width]) if width in UINT else raw


def xxh3_hex(bits: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(bits).view(np.uint8).data)


def compress(data: np.ndarray, level: int, threads: int) -> bytes:
    """zstd frame of an array's bytes; several threads only where the input is large."""
    use = threads if data.nbytes >= (8 << 20) else 0
    return zstandard.ZstdCompressor(level=level, threads=use).compress(data.tobytes())


def decompress(frame: memoryview | bytes, dtype: npt.DTypeLike) -> np.ndarray:
    raw = zstandard.ZstdDecompressor().decompress(frame)
    return np.frombuffer(raw, dtype=dtype)


# ---- magnitude classes ---------------------------------------------------------------------


def magnitude_mask(dtype: torch.dtype, width: int) -> int | None:
    """Mask of the non-sign bits for float dtypes (None: no magnitude context)."""
    return (1 << (8 * width - 1)) - 1 if dtype in MANTISSA_BITS else None


def classes_of(bits: np.ndarray, thresholds: tuple[int, ...], mask: int) -> np.ndarray:
    """(n,) uint8 class index: how many thresholds the magnitude reaches."""
    mag = bits & bits.dtype.type(mask)
    ctx = np.zeros(bits.shape, np.uint8)
    for t in thresholds:
        ctx += mag >= bits.dtype.type(t)
    return ctx


def choose_thresholds(
    base: np.ndarray, changed: np.ndarray, dtype: torch.dtype, classes: int
) -> tuple[int, ...]:
    """Exponent cuts that minimise sum over classes of n_c * H(p_changed_c), by DP."""
    mask = magnitude_mask(dtype, base.dtype.itemsize)
    if mask is None or classes <= 1 or base.size == 0:
        return ()
    shift = MANTISSA_BITS[dtype]
    exponent = ((base & base.dtype.type(mask)) >> base.dtype.type(shift)).astype(np.int64)
    total = np.bincount(exponent)
    moved = np.bincount(exponent[changed], minlength=total.size)
    present = np.flatnonzero(total)
    cuts = _entropy_cuts(total[present], moved[present], classes)
    return tuple(int(present[c]) << shift for c in cuts)


def _entropy_cuts(total: np.ndarray, moved: np.ndarray, classes: int) -> list[int]:
    """Indices i where a new class starts, for the best split into <= `classes` runs."""
    n_cum = np.concatenate([[0], np.cumsum(total)]).astype(np.float64)
    m_cum = np.concatenate([[0], np.cumsum(moved)]).astype(np.float64)
    n = n_cum[None, :] - n_cum[:, None]  # (i, j): elements of bins i..j-1
    m = m_cum[None, :] - m_cum[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, m / n, 0.0)
        h = -(np.where(p > 0, p * np.log2(p), 0) + np.where(p < 1, (1 - p) * np.log2(1 - p), 0))
    cost = np.where(n > 0, n * np.nan_to_num(h), np.inf)
    bins = total.size
    best = cost[0].copy()  # best[j]: one run over bins 0..j-1
    back: list[np.ndarray] = []
    for _ in range(1, min(classes, bins)):
        cand = best[:, None] + cost  # previous runs end at i, new run covers i..j-1
        cand[np.tril_indices(bins + 1)] = np.inf
        arg = np.argmin(cand, axis=0)
        better = cand[arg, np.arange(bins + 1)] < best
        back.append(np.where(better, arg, -1))
        best = np.where(better, cand[arg, np.arange(bins + 1)], best)
    cuts, j = [], bins
    for step in reversed(back):
        if step[j] >= 0:
            j = int(step[j])
            cuts.append(j)
    return sorted(cuts)


# ---- symbol streams ------------------------------------------------------------------------


def gaps_to_symbols(ordinals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ordinals -> (one byte per gap, 255 escaping to a uint64 stream)."""
    gaps = np.diff(ordinals, prepend=-1) - 1
    return np.minimum(gaps, ESCAPE).astype(np.uint8), gaps[gaps >= ESCAPE].astype(np.uint64)


def symbols_to_ordinals(symbols: np.ndarray, escapes: np.ndarray) -> np.ndarray:
    ordinals = symbols.astype(np.int64)
    if escapes.size:
        ordinals[symbols == ESCAPE] = escapes.astype(np.int64)
    ordinals += 1
    np.cumsum(ordinals, out=ordinals)
    ordinals -= 1
    return ordinals


def values_to_symbols(diff: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nonzero wrapped differences -> (the difference as an int8 byte, -128 escaping to raw).

    The byte is the difference itself so decoding is one sign-extending cast; zstd's Huffman
    stage does not care which byte stands for which value.
    """
    signed = diff.view(SINT[diff.dtype.itemsize])
    small = (signed >= -127) & (signed <= 127)
    symbols = np.full(diff.shape, VALUE_ESCAPE, np.uint8)
    symbols[small] = signed[small].astype(np.int8).view(np.uint8)
    return symbols, diff[~small]


def symbols_to_values(symbols: np.ndarray, escapes: np.ndarray, width: int) -> np.ndarray:
    out = symbols.view(np.int8).astype(SINT[width]).view(UINT[width])
    if escapes.size:
        out[symbols == VALUE_ESCAPE] = escapes
    return out
