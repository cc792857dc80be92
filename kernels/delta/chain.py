"""Which releases take a replica from the version it holds to the one it wants.

Deltas are self-inverse, so each delta is an edge both ways between its base and its target;
a snapshot is an edge from anywhere (even from no weights) to its version. `plan_chain` is the
cheapest path by bytes to fetch (fewer steps on ties): usually the chain of deltas from the
current version, the latest snapshot at or before the target when the chain is long or broken.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, Field

from kernels.delta.manifest import DeltaError, DeltaManifest, VersionRef
from kernels.delta.state_dict import ShardReader, apply_delta


class ChainError(DeltaError):
    """No sequence of the available releases reaches the target version."""


class ReleaseInfo(BaseModel):
    """What planning needs of one stored release (a manifest, without its tensor table)."""

    version: int = Field(ge=0)
    kind: Literal["delta", "snapshot"]
    base_version: int | None = None
    nbytes: int = Field(ge=0)

    @classmethod
    def of(cls, manifest: DeltaManifest) -> ReleaseInfo:
        base = manifest.base.version if manifest.base is not None else None
        return cls(version=manifest.target.version, kind=manifest.kind, base_version=base,
                   nbytes=manifest.nbytes)


@dataclass(frozen=True)
class ChainStep:
    """Apply `release`; `backward` when the live weights are at its target (a rollback)."""

    release: ReleaseInfo
    backward: bool = False

    @property
    def reaches(self) -> int:
        if self.backward and self.release.base_version is not None:
            return self.release.base_version
        return self.release.version


def _edges(releases: Sequence[ReleaseInfo]) -> dict[int | None, list[ChainStep]]:
    edges: dict[int | None, list[ChainStep]] = {}
    for r in releases:
        if r.kind == "delta" and r.base_version is not None:
            edges.setdefault(r.base_version, []).append(ChainStep(r))
            edges.setdefault(r.version, []).append(ChainStep(r, backward=True))
    return edges


def plan_chain(
    current_version: int | None, target_version: int, releases: Sequence[ReleaseInfo]
) -> list[ChainStep]:
    """Cheapest steps from `current_version` (None: no weights yet) to `target_version`."""
    edges = _edges(releases)
    snapshots = [ChainStep(r) for r in releases if r.kind == "snapshot"]
    frontier: list[tuple[int, int, int, int | None, list[ChainStep]]] = [
        (0, 0, 0, current_version, [])]
    settled: set[int | None] = set()
    tie = 0
    while frontier:
        cost, _, _, at, path = heapq.heappop(frontier)
        if at == target_version:
            return path
        if at in settled:
            continue
        settled.add(at)
        for step in edges.get(at, []) + snapshots:
            if step.reaches not in settled:
                tie += 1
                heapq.heappush(frontier, (cost + step.release.nbytes, len(path) + 1, tie,
                                          step.reaches, [*path, step]))
    raise ChainError(f"no releases lead from {current_version} to {target_version}")


def apply_chain(
    live: MutableMapping[str, torch.Tensor],
    steps: Sequence[ChainStep],
    open_release: Callable[[ReleaseInfo], tuple[DeltaManifest, ShardReader]],
) -> VersionRef | None:
    """Apply the planned releases in order, each verified before it writes; returns the end."""
    reached = None
    for step in steps:
        manifest, read_shard = open_release(step.release)
        reached = apply_delta(live, manifest, read_shard)
        if reached.version != step.reaches:
            raise ChainError(f"release {step.release.version} led to {reached.version}, "
                             f"the plan expected {step.reaches}")
    return reached
