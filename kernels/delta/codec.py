"""Per-tensor lossless codecs over bit patterns; kernels/delta/state_dict.py applies them
to a whole state dict.

`sparse` is Flywheel's codec. An RL step moves most bf16 weights by 0 or +-1 ulp, and whether
a weight moves depends on its magnitude (a small weight has a small ulp). So it codes
d = new - old on the integer bit pattern (sign-magnitude floats: +-1 ulp is d = +-1), splits
the elements into classes by magnitude thresholds chosen per tensor, and stores per class only
which members changed (gaps, one byte each) and by how much (one signed byte each), with
escape streams for rare big values; zstd then codes streams whose statistics are nearly
order-0, which is what its Huffman stage is good at. Decoding touches each weight once, in
cache-sized chunks, and keeps only the changed positions and their new bit patterns.

Self-inverse: classes come from a value both ends know. Changed elements whose class differs
before and after ("crossers") are coded by position and left out of every class, so a decoder
holding the base or the target sees the same class members and applies +d or -d. `nibble`
(kernels/delta/nibble.py: d in 4 bits for every element) takes over once 1/16 of a tensor
moves: as small there, and cheaper to apply; `exponent_nibble` (kernels/delta/exponent.py)
groups those d's by exponent where asked. `xor` (kernels/delta/planes.py: byte planes of
old ^ new, for changes too dense for both) is self-inverse by construction; `full` (byte
planes of new) is for snapshots; `same` stores nothing.

Every decoder hashes the live tensor while it reads it (so the caller learns whether it holds
the base or the target without a separate pass) and the result it would write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import xxhash
from pydantic import BaseModel, Field

from kernels.delta.classes import ChunkClasses, walk_classes
from kernels.delta.exponent import applies_to, decode_exponent_nibble, encode_exponent_nibble
from kernels.delta.manifest import Codec
from kernels.delta.nibble import NibbleUpdate, decode_nibble, encode_nibble
from kernels.delta.planes import decode_planes, encode_planes
from kernels.delta.streams import (
    CHUNK,
    CorruptStreamError,
    choose_thresholds,
    classes_of,
    compress,
    decompress,
    gaps_to_symbols,
    magnitude_mask,
    symbols_to_ordinals,
    symbols_to_values,
    values_to_symbols,
    xxh3_hex,
)

DENSE_ABOVE = 16  # a decoded tensor with more than 1/16 changed is kept whole
NIBBLE_ABOVE = 1 / 16  # changed share from which the nibble codec is tried
SPARSE_OVER_NIBBLE = 0.9  # nibble is kept unless another is this much smaller (decodes faster)


class CodecOptions(BaseModel):
    """Encoder knobs; decoding needs none of them (the manifest carries what it needs)."""

    zstd_level: int = Field(default=3, ge=1, le=22)
    threads: int = Field(default=2, ge=0, le=64)
    classes: int = Field(default=1, ge=1, le=8)  # 1: fastest decode; 2-4: ~15-30% smaller
    try_xor_above: float = Field(default=0.25, ge=0.0, le=1.0)
    # where many elements move, group a float tensor's d's by exponent (`exponent_nibble`):
    # a third smaller on bf16 RL steps, about 6x slower to apply (bench/delta.py), so for
    # links slow against the model's size; the bootstrap's policy versions use it
    group_by_exponent: bool = False


@dataclass(frozen=True)
class SparseUpdate:
    """New bit patterns at some flat positions of a tensor."""

    positions: np.ndarray  # (n,) int64
    values: np.ndarray  # (n,) uint of the tensor's width

    def apply(self, bits: np.ndarray) -> None:
        if self.positions.size:
            bits[self.positions] = self.values


@dataclass(frozen=True)
class DenseUpdate:
    """Every new bit pattern of a tensor."""

    values: np.ndarray  # (numel,) uint of the tensor's width

    def apply(self, bits: np.ndarray) -> None:
        np.copyto(bits, self.values)


Update = SparseUpdate | DenseUpdate | NibbleUpdate


@dataclass(frozen=True)
class Decoded:
    """A verified-to-be update: what to write, and the xxh3-128 of the live tensor it was
    decoded against (None where the codec needs no base) and of the result."""

    update: Update
    live_xxh3: str | None
    result_xxh3: str


@dataclass(frozen=True)
class Encoded:
    """One tensor's codec, its compressed streams and the sparse codec's parameters."""

    codec: Codec
    streams: list[bytes]
    thresholds: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(len(s) for s in self.streams)


# ---- encode --------------------------------------------------------------------------------


def encode_tensor(
    base: np.ndarray | None, target: np.ndarray, dtype: torch.dtype, options: CodecOptions
) -> Encoded:
    """The smallest of the codecs that apply: same, sparse, xor (or full without a base)."""
    level, threads = options.zstd_level, options.threads
    if base is None:
        return Encoded("full", encode_planes(target, level, threads))
    diff = target - base  # wraps: the integer difference of bit patterns
    changed = np.flatnonzero(diff)
    if changed.size == 0:
        return Encoded("same", [])
    if changed.size >= NIBBLE_ABOVE * diff.size:
        best = Encoded("nibble", encode_nibble(diff, level, threads))
        if options.group_by_exponent and applies_to(dtype):
            grouped = Encoded("exponent_nibble",
                              encode_exponent_nibble(base, diff, dtype, level, threads))
            if grouped.nbytes < SPARSE_OVER_NIBBLE * best.nbytes:
                best = grouped
        if changed.size < 4 * NIBBLE_ABOVE * diff.size:  # sparse can still be smaller here
            sparse = encode_sparse(base, diff, changed, dtype, options)
            if sparse.nbytes < SPARSE_OVER_NIBBLE * best.nbytes:
                best = sparse
    else:
        best = encode_sparse(base, diff, changed, dtype, options)
    if changed.size > options.try_xor_above * diff.size:
        xor = Encoded("xor", encode_planes(base ^ target, level, threads))
        best = min(best, xor, key=lambda e: e.nbytes)
    return best


def encode_sparse(
    base: np.ndarray,
    diff: np.ndarray,
    changed: np.ndarray,
    dtype: torch.dtype,
    options: CodecOptions,
) -> Encoded:
    """Crossers by position, then per class the gaps between changed members and the d's."""
    mask = magnitude_mask(dtype, base.dtype.itemsize)
    thresholds = choose_thresholds(base, changed, dtype, options.classes)
    crossers = np.empty(0, np.int64)
    if thresholds and mask is not None:
        before = classes_of(base[changed], thresholds, mask)
        after = classes_of(base[changed] + diff[changed], thresholds, mask)
        crossers = changed[before != after]
    ordinals, values = _class_changes(base, diff, thresholds, mask, crossers)
    gaps = [gaps_to_symbols(o) for o in ordinals]  # gaps restart in every class
    gap_syms = np.concatenate([g[0] for g in gaps])
    gap_esc = np.concatenate([g[1] for g in gaps])
    val_syms, val_esc = values_to_symbols(np.concatenate(values))
    parts = [crossers, diff[crossers], gap_syms, gap_esc, val_syms, val_esc]
    streams = [compress(p, options.zstd_level, options.threads) for p in parts]
    counts = tuple(len(o) for o in ordinals)
    return Encoded("sparse", streams, thresholds, counts)


def _class_changes(
    base: np.ndarray,
    diff: np.ndarray,
    thresholds: tuple[int, ...],
    mask: int | None,
    crossers: np.ndarray,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per class: ordinals (rank among the class members) of the changed members, their d's."""
    if not thresholds:
        changed = np.flatnonzero(diff)
        return [changed], [diff[changed]]
    ordinals: list[list[np.ndarray]] = [[] for _ in range(len(thresholds) + 1)]
    values: list[list[np.ndarray]] = [[] for _ in range(len(thresholds) + 1)]
    offsets = [0] * (len(thresholds) + 1)
    for start, classes in walk_classes(base, thresholds, mask, crossers):
        chunk = diff[start : start + CHUNK]
        for g in range(classes.classes):
            ranks, local = classes.changes(g, chunk)
            ordinals[g].append(ranks + offsets[g])
            values[g].append(chunk[local])
            offsets[g] += classes.count(g)
    return ([_cat(o, np.int64) for o in ordinals],
            [_cat(v, diff.dtype) for v in values])


# ---- decode --------------------------------------------------------------------------------


def decode_tensor(
    codec: str,
    frames: Sequence[memoryview],
    live: np.ndarray,
    dtype: torch.dtype,
    *,
    thresholds: tuple[int, ...] = (),
    counts: tuple[int, ...] = (),
    backward: bool = False,
) -> Decoded:
    """Decode one tensor against the live bit patterns (read only): the update and hashes."""
    if codec == "same":
        digest = xxh3_hex(live)
        return Decoded(SparseUpdate(np.empty(0, np.int64), live[:0].copy()), digest, digest)
    if codec == "full":
        values = decode_planes(frames, live)
        return Decoded(DenseUpdate(values), None, xxh3_hex(values))
    if codec == "xor":
        values = decode_planes(frames, live) ^ live
        return Decoded(DenseUpdate(values), xxh3_hex(live), xxh3_hex(values))
    if codec == "nibble":
        return Decoded(*decode_nibble(frames, live, backward))
    if codec == "exponent_nibble":
        values, live_hash, result_hash = decode_exponent_nibble(frames, live, dtype, backward)
        return Decoded(DenseUpdate(values), live_hash, result_hash)
    if codec == "sparse" and not thresholds:
        return decode_sparse_flat(frames, live, counts, backward)
    if codec == "sparse":
        return decode_sparse(frames, live, dtype, thresholds, counts, backward)
    raise CorruptStreamError(f"unknown codec {codec!r}")


def decode_sparse_flat(
    frames: Sequence[memoryview], live: np.ndarray, counts: tuple[int, ...], backward: bool
) -> Decoded:
    """The one-class sparse codec: positions from the gaps, new values by one gather, then a
    pass over `live` in chunks that hashes it and the result (a copy with the changes in)."""
    if len(frames) != 6 or len(counts) != 1:
        raise CorruptStreamError("sparse codec: wrong number of streams or class counts")
    gap_esc = decompress(frames[3], np.uint64)
    if decompress(frames[0], np.int64).size or (gap_esc.size and gap_esc.max() >= live.size):
        raise CorruptStreamError("sparse codec: gaps outside the tensor")
    positions = symbols_to_ordinals(decompress(frames[2], np.uint8), gap_esc)
    d = symbols_to_values(decompress(frames[4], np.uint8), decompress(frames[5], live.dtype),
                          live.dtype.itemsize)
    if d.size != positions.size or positions.size != counts[0] or (
            positions.size and positions[-1] >= live.size):
        raise CorruptStreamError("sparse codec: positions do not fit the tensor")
    new = np.empty(positions.size, live.dtype)
    cuts = np.searchsorted(positions, np.arange(0, live.size + CHUNK, CHUNK))
    live_hash, result_hash = xxhash.xxh3_128(), xxhash.xxh3_128()
    buf = np.empty(min(CHUNK, live.size), live.dtype)
    for i, start in enumerate(range(0, live.size, CHUNK)):
        seg = live[start : start + CHUNK]
        live_hash.update(seg.data)
        lo, hi = cuts[i], cuts[i + 1]
        if lo == hi:
            result_hash.update(seg.data)
            continue
        local, values = positions[lo:hi] - start, new[lo:hi]
        np.take(seg, local, out=values)  # the gather while the chunk is in cache
        if backward:
            values -= d[lo:hi]
        else:
            values += d[lo:hi]
        out = buf[: seg.size]
        np.copyto(out, seg)
        out[local] = values
        result_hash.update(out.data)
    return Decoded(SparseUpdate(positions, new), live_hash.hexdigest(), result_hash.hexdigest())


def decode_sparse(
    frames: Sequence[memoryview],
    live: np.ndarray,
    dtype: torch.dtype,
    thresholds: tuple[int, ...],
    counts: tuple[int, ...],
    backward: bool,
) -> Decoded:
    """Walk the live tensor in chunks: find each class's changed members, hash the result."""
    if len(frames) != 6 or len(counts) != len(thresholds) + 1:
        raise CorruptStreamError("sparse codec: wrong number of streams or class counts")
    width, kind = live.dtype.itemsize, live.dtype
    crossers = decompress(frames[0], np.int64)
    cross_d = decompress(frames[1], kind)
    ordinals = _split_ordinals(decompress(frames[2], np.uint8), decompress(frames[3], np.uint64),
                               counts)
    diffs = np.split(symbols_to_values(decompress(frames[4], np.uint8),
                                       decompress(frames[5], kind), width),
                     np.cumsum(counts)[:-1])
    if cross_d.size != crossers.size or (crossers.size and not 0 <= crossers[0] <= crossers[-1]
                                         < live.size):
        raise CorruptStreamError("sparse codec: crosser positions outside the tensor")
    mask = magnitude_mask(dtype, width) if thresholds else None
    live_hash, hasher = xxhash.xxh3_128(), xxhash.xxh3_128()
    # Many changes: keep the whole new tensor (commit is then one memcpy, not a scatter).
    dense = sum(counts) + crossers.size > live.size // DENSE_ABOVE
    out = np.empty(live.size if dense else min(CHUNK, live.size), kind)
    cursor = _Cursor(ordinals, diffs)
    positions, values = [], []
    for start, classes in walk_classes(live, thresholds, mask, crossers):
        chunk = live[start : start + CHUNK]
        live_hash.update(chunk.data)
        lo, hi = np.searchsorted(crossers, [start, start + CHUNK])
        local, d = cursor.take(classes, crossers[lo:hi] - start, cross_d[lo:hi])
        new = chunk[local] - d if backward else chunk[local] + d
        buf = out[start : start + chunk.size] if dense else out[: chunk.size]
        buf[:] = chunk
        buf[local] = new
        hasher.update(buf.data)
        if not dense:
            positions.append(local + start)
            values.append(new)
    cursor.check_done()
    update: Update = DenseUpdate(out) if dense else SparseUpdate(_cat(positions, np.int64),
                                                                 _cat(values, kind))
    return Decoded(update, live_hash.hexdigest(), hasher.hexdigest())


class _Cursor:
    """Hands out, chunk by chunk, each class's changed members and their d's."""

    def __init__(self, ordinals: list[np.ndarray], diffs: list[np.ndarray]):
        self.ordinals, self.diffs = ordinals, diffs
        self.taken = [0] * len(ordinals)
        self.members_before = [0] * len(ordinals)

    def take(
        self, classes: ChunkClasses, cross_local: np.ndarray, cross_d: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        locals_, ds = [cross_local], [cross_d]
        for g, ords in enumerate(self.ordinals):
            first = self.members_before[g]
            past = first + classes.count(g)
            end = int(np.searchsorted(ords, past))
            locals_.append(classes.positions(g, ords[self.taken[g] : end] - first))
            ds.append(self.diffs[g][self.taken[g] : end])
            self.taken[g], self.members_before[g] = end, past
        return np.concatenate(locals_), np.concatenate(ds)

    def check_done(self) -> None:
        if any(t != o.size for t, o in zip(self.taken, self.ordinals, strict=True)):
            raise CorruptStreamError("sparse codec: changes past the end of their class")


def _split_ordinals(
    symbols: np.ndarray, escapes: np.ndarray, counts: tuple[int, ...]
) -> list[np.ndarray]:
    if symbols.size != sum(counts) or escapes.size != int(np.count_nonzero(symbols == 255)):
        raise CorruptStreamError("sparse codec: gap stream does not match the class counts")
    cuts = np.cumsum(counts)[:-1]
    esc_cuts = [int(np.count_nonzero(s == 255)) for s in np.split(symbols, cuts)]
    return [symbols_to_ordinals(s, e) for s, e in zip(np.split(symbols, cuts),
                                                      np.split(escapes, np.cumsum(esc_cuts)[:-1]),
                                                      strict=True)]


def _cat(parts: list[np.ndarray], dtype: npt.DTypeLike) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, dtype)

