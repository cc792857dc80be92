"""Wire types of a release: the manifest (JSON) that names a delta or snapshot and its shards.

Invariants, checked by the decoder before any live weight is touched:
- a `delta` manifest has a `base`; a `snapshot` has none and only `full` tensors;
- every frame lies inside the concatenation of the shards, in manifest order;
- `base_xxh3` / `target_xxh3` are xxh3-128 hex digests of each tensor's raw bytes, so one
  delta is verified in either direction (it is self-inverse, see kernels/delta/codec.py);
- `base.sha256` / `target.sha256` are `kernels.weights.state_dict_sha256` of the whole model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

Codec = Literal["same", "sparse", "nibble", "exponent_nibble", "xor", "full"]


class DeltaError(Exception):
    """A release that cannot be encoded, planned or applied (the message says why)."""


class DeltaVerificationError(DeltaError):
    """A shard, a base tensor or a decoded tensor fails its hash; live weights are untouched."""


class BaseMismatchError(DeltaVerificationError):
    """The live weights are neither the base nor the target of the delta being applied."""


class VersionRef(BaseModel):
    """An immutable set of weights: its version number and whole-model sha256."""

    version: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Frame(BaseModel):
    """One zstd frame, addressed in the concatenation of all shards."""

    offset: int = Field(ge=0)
    length: int = Field(ge=0)


class TensorEntry(BaseModel):
    """How one tensor is coded; `thresholds` and `counts` only for the sparse codec."""

    name: str
    dtype: str
    shape: list[int]
    codec: Codec
    base_xxh3: str | None = None
    target_xxh3: str
    frames: list[Frame] = []
    thresholds: list[int] = []
    counts: list[int] = []


class ShardRef(BaseModel):
    name: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class DeltaManifest(BaseModel):
    """A release as stored next to its shards (`manifest.json`)."""

    # 2 adds the nibble codec, 3 exponent_nibble; the earlier ones are still read
    schema_version: Literal[1, 2, 3] = 3
    kind: Literal["delta", "snapshot"]
    base: VersionRef | None
    target: VersionRef
    shard_bytes: int = Field(ge=1)
    tensors: list[TensorEntry]
    shards: list[ShardRef]

    @model_validator(mode="after")
    def _consistent(self) -> DeltaManifest:
        if (self.kind == "delta") != (self.base is not None):
            raise ValueError("a delta names its base, a snapshot does not")
        if self.kind == "snapshot" and any(t.codec != "full" for t in self.tensors):
            raise ValueError("a snapshot codes every tensor with the full codec")
        total = sum(s.size for s in self.shards)
        for t in self.tensors:
            if any(f.offset + f.length > total for f in t.frames):
                raise ValueError(f"tensor {t.name}: frame outside the shards")
        return self

    @property
    def nbytes(self) -> int:
        """Bytes to transfer: the sum of the shard sizes."""
        return sum(s.size for s in self.shards)
