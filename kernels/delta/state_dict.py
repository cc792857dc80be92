"""Lossless releases of a state dict: deltas between two versions, and full snapshots.

`encode_delta(base, target)` codes every tensor with the smallest codec of
kernels/delta/codec.py and cuts the frames into shards of bounded size with a manifest
(kernels/delta/manifest.py). A delta is self-inverse: applied to the base it yields the target,
applied to the target it yields the base; `prepare` tells which from the live weights.

Applying is two-phase so a server can prepare while serving and commit in a short pause:
`prepare` checks every shard's sha256, that the live weights are the delta's base (or target),
decodes into scratch buffers and checks each result tensor's xxh3-128; only then does `commit`
write the changed bit patterns into the live tensors. Any failure raises before a live weight
is touched. `apply_delta` is both phases at once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import zstandard
from pydantic import Field

from kernels.delta.codec import (
    CodecOptions,
    CorruptStreamError,
    DenseUpdate,
    Encoded,
    SparseUpdate,
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
from kernels.delta.streams import tensor_bits, xxh3_hex
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


def read_verified_shards(manifest: DeltaManifest, read_shard: ShardReader) -> memoryview:
    """All shards end to end, each checked against its sha256 in the manifest."""
    parts = []
    for ref in manifest.shards:
        data = read_shard(ref.name)
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
            raise DeltaVerificationError(f"shard {ref.name}: sha256 mismatch, refusing")
        parts.append(data)
    return memoryview(b"".join(parts))


def prepare(
    live: StateDict,
    manifest: DeltaManifest,
    read_shard: ShardReader,
    *,
    live_sha256: str | None = None,
    threads: int = 2,
) -> PreparedDelta:
    """Verify and decode a release against the live weights without writing to them."""
    backward = _direction(live, manifest, live_sha256)
    blob = read_verified_shards(manifest, read_shard)
    entries = {t.name: t for t in manifest.tensors}
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        decoded = pool.map(lambda t: _decode_verified(t, live[t.name], blob, backward),
                           manifest.tensors)
        updates = dict(zip(entries, decoded, strict=True))
    reaches = manifest.base if backward and manifest.base is not None else manifest.target
    return PreparedDelta(reaches=reaches, updates=updates)


def _direction(live: StateDict, manifest: DeltaManifest, live_sha256: str | None) -> bool:
    """False: live is the base (or anything, for a snapshot); True: live is the target."""
    if set(live) != {t.name for t in manifest.tensors}:
        raise DeltaError("the live weights and the release name different tensors")
    for t in manifest.tensors:
        tensor = live[t.name]
        if str(tensor.dtype).removeprefix("torch.") != t.dtype or list(tensor.shape) != t.shape:
            raise DeltaError(f"{t.name}: live dtype/shape differs from the release")
    if manifest.base is None:
        return False
    digests = {t.name: xxh3_hex(tensor_bits(live[t.name])) for t in manifest.tensors}
    at_base = all(digests[t.name] == t.base_xxh3 for t in manifest.tensors)
    at_target = all(digests[t.name] == t.target_xxh3 for t in manifest.tensors)
    if live_sha256 is not None:
        at_base &= live_sha256 == manifest.base.sha256
        at_target &= live_sha256 == manifest.target.sha256
    if not (at_base or at_target):
        raise BaseMismatchError(
            f"live weights are neither version {manifest.base.version} nor "
            f"{manifest.target.version} of this delta, refusing")
    return not at_base


def _decode_verified(
    entry: TensorEntry, tensor: torch.Tensor, blob: memoryview, backward: bool
) -> Update:
    frames = [blob[f.offset : f.offset + f.length] for f in entry.frames]
    if backward and entry.codec == "full":
        raise DeltaError(f"{entry.name}: a full tensor cannot be applied backwards")
    try:
        update, digest = decode_tensor(
            entry.codec, frames, tensor_bits(tensor), tensor.dtype,
            thresholds=tuple(entry.thresholds), counts=tuple(entry.counts), backward=backward)
    except (CorruptStreamError, IndexError, ValueError, zstandard.ZstdError) as exc:
        raise DeltaVerificationError(f"{entry.name}: undecodable ({exc}), refusing") from exc
    expected = entry.base_xxh3 if backward else entry.target_xxh3
    if digest != expected:
        raise DeltaVerificationError(f"{entry.name}: decoded tensor fails its xxh3, refusing")
    return update


def commit(live: MutableMapping[str, torch.Tensor], prepared: PreparedDelta) -> VersionRef:
    """Write verified bit patterns into the live tensors in place; returns the version reached."""
    for name, update in prepared.updates.items():
        bits = tensor_bits(live[name])
        if isinstance(update, SparseUpdate):
            bits[update.positions] = update.values
        elif isinstance(update, DenseUpdate):
            np.copyto(bits, update.values)
    return prepared.reaches


def apply_delta(
    live: MutableMapping[str, torch.Tensor],
    manifest: DeltaManifest,
    read_shard: ShardReader,
    *,
    live_sha256: str | None = None,
) -> VersionRef:
    """`prepare` then `commit`: a failed check raises with the live weights untouched."""
    return commit(live, prepare(live, manifest, read_shard, live_sha256=live_sha256))
