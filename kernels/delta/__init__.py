"""Lossless releases of a state dict, shared by the trainer (encodes) and serving (applies).

- `state_dict.py`: `encode_delta` / `encode_snapshot`, and `prepare` + `commit` (= `apply_delta`);
- `codec.py`, `streams.py`, `classes.py`: the per-tensor codecs over bit patterns;
- `manifest.py`: the wire types (manifest, shards, hashes);
- `chain.py`: which releases take a replica from the version it holds to the one it wants;
- `store.py`: where releases live (a directory or any fsspec URL), laid out as both ends read it.
"""

from kernels.delta.manifest import (
    BaseMismatchError,
    DeltaError,
    DeltaManifest,
    DeltaVerificationError,
    VersionRef,
)
from kernels.delta.state_dict import (
    DeltaOptions,
    EncodedRelease,
    PreparedDelta,
    ShardReader,
    apply_delta,
    commit,
    encode_delta,
    encode_snapshot,
    prepare,
)

__all__ = [
    "BaseMismatchError", "DeltaError", "DeltaManifest", "DeltaOptions",
    "DeltaVerificationError", "EncodedRelease", "PreparedDelta", "ShardReader", "VersionRef",
    "apply_delta", "commit", "encode_delta", "encode_snapshot", "prepare",
]
