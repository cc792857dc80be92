"""The release pipeline's seam to the artifact store and the delta codec.

Four calls are all the pipeline and the replicas use: `store_delta`, `store_snapshot`,
`load_snapshot`, `apply_delta`. Until the lossless codec (trainer/delta*.py) and the artifact
store (trainer/artifacts.py) land, this module holds an interim XOR + zstd coding with the same
contract: a manifest (JSON) naming the base and target whole-model sha256 and, per shard, its
tensors and sha256; every shard is verified before any weight is touched, and the result is
verified against the manifest after. XOR is its own inverse: the same delta goes both ways.

Artifacts live under any fsspec URL (a local directory by default):
`<store>/v<version>/delta/manifest.json`, `<store>/v<version>/snapshot/manifest.json`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
import zstandard

from kernels.weights import state_dict_sha256, tensor_bytes

SHARD_BYTES = 64 << 20
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReleaseIntegrityError(ValueError):
    """An artifact that fails verification (corrupt shard, wrong base, wrong result)."""


def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    fs, _, paths = fsspec.get_fs_token_paths(url)
    return fs, paths[0]


def _write(url: str, name: str, data: bytes) -> None:
    fs, root = _fs(url)
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/{name}", "wb") as f:
        f.write(data)


def _read(url: str, name: str) -> bytes:
    fs, root = _fs(url)
    with fs.open(f"{root}/{name}", "rb") as f:
        return bytes(f.read())


def _shards(names: list[str], sizes: Mapping[str, int]) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        if shards[-1] and used + sizes[name] > SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def _store(url: str, tensors: Mapping[str, torch.Tensor], header: dict[str, Any]) -> str:
    names = sorted(tensors)
    cctx = zstandard.ZstdCompressor(level=3)
    shard_entries = []
    for i, group in enumerate(_shards(names, {n: tensors[n].nbytes for n in names})):
        raw = b"".join(bytes(tensor_bytes(tensors[n])) for n in group)
        blob = cctx.compress(raw)
        _write(url, f"shard-{i:05d}.zst", blob)
        shard_entries.append({"file": f"shard-{i:05d}.zst", "tensors": group,
                              "sha256": hashlib.sha256(blob).hexdigest()})
    meta = {n: {"dtype": str(tensors[n].dtype).removeprefix("torch."),
                "shape": list(tensors[n].shape)} for n in names}
    manifest = {**header, "tensors": meta, "shards": shard_entries}
    _write(url, "manifest.json", json.dumps(manifest, indent=1).encode())
    return f"{url}/manifest.json"


def _xor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    view = _INT_VIEW[a.element_size()]
    return torch.bitwise_xor(a.contiguous().view(view), b.contiguous().view(view)).view(a.dtype)


def store_delta(store_url: str, version: int, base: Mapping[str, torch.Tensor],
                target: Mapping[str, torch.Tensor], *, base_version: int) -> str:
    """Write the delta base -> target for `version`; returns its manifest URI."""
    if set(base) != set(target):
        raise ReleaseIntegrityError(f"tensor names differ: {sorted(set(base) ^ set(target))[:5]}")
    header = {"kind": "delta", "version": version, "base_version": base_version,
              "base_sha256": state_dict_sha256(base), "sha256": state_dict_sha256(target),
              "codec": "xor-zstd3"}
    return _store(f"{store_url.rstrip('/')}/v{version}/delta",
                  {n: _xor(base[n], target[n]) for n in base}, header)


def store_snapshot(store_url: str, version: int, weights: Mapping[str, torch.Tensor]) -> str:
    header = {"kind": "snapshot", "version": version, "sha256": state_dict_sha256(weights),
              "codec": "zstd3"}
    return _store(f"{store_url.rstrip('/')}/v{version}/snapshot", weights, header)


def _load(manifest_uri: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read and verify every shard (sha256 of the stored bytes) before decoding any tensor."""
    url = manifest_uri.removesuffix("/manifest.json")
    try:
        manifest = json.loads(_read(url, "manifest.json"))
    except (OSError, ValueError) as exc:
        raise ReleaseIntegrityError(f"{manifest_uri}: unreadable manifest: {exc}") from exc
    blobs = []
    for shard in manifest["shards"]:
        blob = _read(url, shard["file"])
        if hashlib.sha256(blob).hexdigest() != shard["sha256"]:
            raise ReleaseIntegrityError(f"{url}/{shard['file']}: sha256 mismatch, refusing")
        blobs.append((shard, blob))
    out: dict[str, torch.Tensor] = {}
    dctx = zstandard.ZstdDecompressor()
    for shard, blob in blobs:
        raw = bytearray(dctx.decompress(blob))
        offset = 0
        for name in shard["tensors"]:
            meta = manifest["tensors"][name]
            dtype = getattr(torch, meta["dtype"])
            count = 1
            for d in meta["shape"]:
                count *= d
            nbytes = count * torch.empty((), dtype=dtype).element_size()
            chunk = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes, offset=offset)
            out[name] = chunk.view(dtype).reshape(meta["shape"]).clone()
            offset += nbytes
    return manifest, out


def load_snapshot(manifest_uri: str) -> dict[str, torch.Tensor]:
    manifest, weights = _load(manifest_uri)
    if state_dict_sha256(weights) != manifest["sha256"]:
        raise ReleaseIntegrityError(f"{manifest_uri}: snapshot does not hash to its manifest")
    return weights


def apply_delta(manifest_uri: str, weights: MutableMapping[str, torch.Tensor]) -> str:
    """Apply a delta in place, forward (weights at base) or backward (weights at target).

    Verifies shards and the starting hash first, so a bad artifact leaves `weights` untouched;
    returns the sha256 reached.
    """
    manifest, xor = _load(manifest_uri)
    start = state_dict_sha256(weights)
    if start == manifest["base_sha256"]:
        goal = manifest["sha256"]
    elif start == manifest["sha256"]:
        goal = manifest["base_sha256"]
    else:
        raise ReleaseIntegrityError(f"{manifest_uri}: weights {start[:12]} are neither the "
                                    f"base {manifest['base_sha256'][:12]} nor the target "
                                    f"{manifest['sha256'][:12]} of this delta")
    if set(xor) != set(weights):
        raise ReleaseIntegrityError(f"{manifest_uri}: tensor names do not match the model")
    for name, tensor in xor.items():
        weights[name] = _xor(weights[name], tensor)
    reached = state_dict_sha256(weights)
    if reached != goal:
        raise ReleaseIntegrityError(f"{manifest_uri}: applied delta hashes to {reached[:12]}, "
                                    f"manifest says {goal[:12]}")
    return reached
