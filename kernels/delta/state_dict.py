"""Lossless releases of a state dict: deltas between two versions, and full snapshots.

`encode_delta(base, target)` codes every tensor with the smallest codec of
kernels/delta/codec.py and cuts the frames into shards of bounded size with a manifest
(kernels/delta/manifest.py). A delta is self-inverse: applied to the base it yields the target,
applied to the target it yields the base; `prepare` tells which from the live weights.

Applying is two-phase so a server can prepare while serving and commit in a short pause:
`prepare` checks every shard's sha256, that the live weights are the delta's base (or target:
each tensor's xxh3-128), decodes into scratch buffers and checks each result tensor's
xxh3-128; only then does `commit` write the changed bit patterns into the live tensors. Any
failure raises before a live weight is touched. `apply_delta` is both phases at once. Both
phases run on a small thread pool (zstd, hashlib, xxhash and numpy release the GIL).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import zstandard
from pydantic import Field

from kernels.delta.codec import (
    CodecOptions,
    Decoded,
    Encoded,
    Update,
    decode_tensor,
    encode_tensor,
)
from kernels.delta.manifest import (
    BaseMismatchError,
    DeltaError,
    DeltaManifest,
    DeltaVerificationError,
    Frame,
    ShardRef,
    TensorEntry,
    VersionRef,
)
from kernels.delta.streams import CorruptStreamError, tensor_bits, xxh3_hex
from kernels.weights import state_dict_sha256

StateDict = Mapping[str, torch.Tensor]
ShardReader = Callable[[str], bytes]



class DeltaOptions(CodecOptions):
    """Encoder knobs plus the shard size (bytes) for parallel transfer."""

    shard_bytes: int = Field(default=64 << 20, ge=1)


@dataclass(frozen=True)
class EncodedRelease:
    """A manifest and its shards by name, ready for the artifact store."""

    manifest: DeltaManifest
    shards: dict[str, bytes]


@dataclass(frozen=True)
class PreparedDelta:
    """Verified new bit patterns per tensor; `commit` writes them and reaches `reaches`."""

    reaches: VersionRef
    updates: dict[str, Update]


# ---- encode --------------------------------------------------------------------------------


def encode_delta(
    base: StateDict,
    target: StateDict,
    *,
    base_version: int,
    target_version: int,
    options: DeltaOptions | None = None,
    base_sha256: str | None = None,
    target_sha256: str | None = None,
) -> EncodedRelease:
    """The self-inverse delta base <-> target; both must have the same names, dtypes, shapes."""
    _check_same_layout(base, target)
    opts = options or DeltaOptions()
    coded = {
        name: encode_tensor(tensor_bits(base[name]), tensor_bits(target[name]),
                            target[name].dtype, opts)
        for name in sorted(target)
    }
    base_ref = VersionRef(version=base_version, sha256=base_sha256 or state_dict_sha256(base))
    target_ref = VersionRef(version=target_version,
                            sha256=target_sha256 or state_dict_sha256(target))
    return _package("delta", base_ref, target_ref, target, coded, opts.shard_bytes, base)


def encode_snapshot(
    weights: StateDict,
    *,
    version: int,
    options: DeltaOptions | None = None,
    sha256: str | None = None,
) -> EncodedRelease:
    """Every tensor in full (byte planes, zstd): applies to any live weights of this layout."""
    opts = options or DeltaOptions()
    coded = {name: encode_tensor(None, tensor_bits(weights[name]), weights[name].dtype, opts)
             for name in sorted(weights)}
    ref = VersionRef(version=version, sha256=sha256 or state_dict_sha256(weights))
    return _package("snapshot", None, ref, weights, coded, opts.shard_bytes, None)


def _check_same_layout(base: StateDict, target: StateDict) -> None:
    if set(base) != set(target):
        raise DeltaError(f"tensor names differ: {sorted(set(base) ^ set(target))[:5]}")
    for name, t in target.items():
        if t.dtype != base[name].dtype or t.shape != base[name].shape:
            raise DeltaError(f"{name}: dtype or shape differs between base and target")


def _package(
    kind: Literal["delta", "snapshot"],
    base_ref: VersionRef | None,
    target_ref: VersionRef,
    target: StateDict,
    coded: dict[str, Encoded],
    shard_bytes: int,
    base: StateDict | None,
) -> EncodedRelease:
    """Lay the frames end to end, cut the bytes into shards, describe it all in a manifest."""
    entries, frames, offset = [], [], 0
    for name, enc in coded.items():
        spans = []
        for stream in enc.streams:
            spans.append(Frame(offset=offset, length=len(stream)))
            frames.append(stream)
            offset += len(stream)
        entries.append(TensorEntry(
            name=name, dtype=str(target[name].dtype).removeprefix("torch."),
            shape=list(target[name].shape), codec=enc.codec, frames=spans,
            base_xxh3=xxh3_hex(tensor_bits(base[name])) if base is not None else None,
            target_xxh3=xxh3_hex(tensor_bits(target[name])),
            thresholds=list(enc.thresholds), counts=list(enc.counts)))
    blob = b"".join(frames)
    shards = {f"shard-{i:05d}.bin": blob[start : start + shard_bytes]
              for i, start in enumerate(range(0, max(len(blob), 1), shard_bytes))}
    refs = [ShardRef(name=n, size=len(b), sha256=hashlib.sha256(b).hexdigest())
            for n, b in shards.items()]
    manifest = DeltaManifest(kind=kind, base=base_ref, target=target_ref,
                             shard_bytes=shard_bytes, tensors=entries, shards=refs)
    return EncodedRelease(manifest, shards)


# ---- apply ---------------------------------------------------------------------------------


def prepare(
    live: StateDict,
    manifest: DeltaManifest,
    read_shard: ShardReader,
    *,
    live_sha256: str | None = None,
    threads: int = 2,
) -> PreparedDelta:
    """Verify and decode a release against the live weights without writing to them.

    One pass over the live weights: each tensor is decoded as if the live weights were the
    base, hashing them on the way; if they turn out to be the target (a rollback), the
    tensors are decoded again backwards. Shards are hashed on the same thread pool.
    """
    _check_layout(live, manifest)
    parts = [read_shard(ref.name) for ref in manifest.shards]
    blob = memoryview(b"".join(parts))
    bits = {t.name: tensor_bits(live[t.name]) for t in manifest.tensors}
    biggest_first = sorted(manifest.tensors, key=lambda t: -bits[t.name].size)

    def decode_all(pool: ThreadPoolExecutor, backward: bool) -> dict[str, Future[Decoded]]:
        return {t.name: pool.submit(_decode, t, live[t.name].dtype, bits[t.name], blob, backward)
                for t in biggest_first}

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        try:
            checks = [pool.submit(_check_shard, ref, data)
                      for ref, data in zip(manifest.shards, parts, strict=True)]
            futures = decode_all(pool, backward=False)
            for check in checks:  # a bad shard explains bad frames: report it first
                check.result()
            decoded = {name: f.result() for name, f in futures.items()}
            backward = _direction(manifest, decoded, live_sha256)
            if backward:
                decoded = {name: f.result() for name, f in decode_all(pool, True).items()}
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    for t in manifest.tensors:
        if decoded[t.name].result_xxh3 != (t.base_xxh3 if backward else t.target_xxh3):
            raise DeltaVerificationError(f"{t.name}: decoded tensor fails its xxh3, refusing")
    reaches = manifest.base if backward and manifest.base is not None else manifest.target
    return PreparedDelta(reaches=reaches,
                         updates={t.name: decoded[t.name].update for t in manifest.tensors})


def _check_shard(ref: ShardRef, data: bytes) -> None:
    if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
        raise DeltaVerificationError(f"shard {ref.name}: sha256 mismatch, refusing")


def _check_layout(live: StateDict, manifest: DeltaManifest) -> None:
    if set(live) != {t.name for t in manifest.tensors}:
        raise DeltaError("the live weights and the release name different tensors")
    for t in manifest.tensors:
        tensor = live[t.name]
        if str(tensor.dtype).removeprefix("torch.") != t.dtype or list(tensor.shape) != t.shape:
            raise DeltaError(f"{t.name}: live dtype/shape differs from the release")


def _direction(manifest: DeltaManifest, decoded: Mapping[str, Decoded],
               live_sha256: str | None) -> bool:
    """False: live is the base (or anything, for a snapshot); True: live is the target."""
    if manifest.base is None:
        return False
    at_base = all(decoded[t.name].live_xxh3 == t.base_xxh3 for t in manifest.tensors)
    at_target = all(decoded[t.name].live_xxh3 == t.target_xxh3 for t in manifest.tensors)
    if live_sha256 is not None:
        at_base &= live_sha256 == manifest.base.sha256
        at_target &= live_sha256 == manifest.target.sha256
    if not (at_base or at_target):
        raise BaseMismatchError(
            f"live weights are neither version {manifest.base.version} nor "
            f"{manifest.target.version} of this delta, refusing")
    return not at_base


def _decode(entry: TensorEntry, dtype: torch.dtype, bits: np.ndarray, blob: memoryview,
            backward: bool) -> Decoded:
    frames = [blob[f.offset : f.offset + f.length] for f in entry.frames]
    if backward and entry.codec == "full":
        raise DeltaError(f"{entry.name}: a full tensor cannot be applied backwards")
    try:
        return decode_tensor(entry.codec, frames, bits, dtype,
                             thresholds=tuple(entry.thresholds), counts=tuple(entry.counts),
                             backward=backward)
    except (CorruptStreamError, IndexError, ValueError, zstandard.ZstdError) as exc:
        raise DeltaVerificationError(f"{entry.name}: undecodable ({exc}), refusing") from exc


def commit(live: MutableMapping[str, torch.Tensor], prepared: PreparedDelta, *,
           threads: int = 2) -> VersionRef:
    """Write verified bit patterns into the live tensors in place; returns the version reached.

    Names that share one storage (a language-model head tied to the embeddings) are written
    once: an update may add to the bits in place (the nibble codec), and twice is not once."""
    written: set[tuple[int, int]] = set()
    items = []
    for name, update in sorted(prepared.updates.items(), key=lambda kv: -live[kv[0]].numel()):
        storage = (live[name].data_ptr(), live[name].numel())
        if storage not in written:
            written.add(storage)
            items.append((name, update))
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for done in [pool.submit(update.apply, tensor_bits(live[name])) for name, update in items]:
            done.result()
    return prepared.reaches


def apply_delta(
    live: MutableMapping[str, torch.Tensor],
    manifest: DeltaManifest,
    read_shard: ShardReader,
    *,
    live_sha256: str | None = None,
    threads: int = 2,
) -> VersionRef:
    """`prepare` then `commit`: a failed check raises with the live weights untouched."""
    prepared = prepare(live, manifest, read_shard, live_sha256=live_sha256, threads=threads)
    return commit(live, prepared, threads=threads)
