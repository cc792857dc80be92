"""Magnitude classes of one chunk, shared by the sparse encoder and decoder.

The sparse codec names a changed element by its rank among the members of its class. Listing
the members of every class costs a pass per class, so only the small classes (magnitudes
below the last threshold, plus the excluded crossers) are listed; the last class, usually
most of the tensor, stays implicit: with `others` the sorted positions outside it,
a last-class element at position p has rank r = p - #(others < p), and conversely
p = r + #(others - index <= r), one binary search per changed element instead of a pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kernels.delta.streams import CHUNK, classes_of


@dataclass(frozen=True)
class ChunkClasses:
    """Class members of one chunk of `size` elements, as chunk-local positions."""

    size: int
    small: list[np.ndarray]  # members of classes 0 .. n-2, sorted
    others: np.ndarray  # sorted positions outside the last class (small classes, crossers)

    @property
    def classes(self) -> int:
        return len(self.small) + 1

    def count(self, g: int) -> int:
        return self.small[g].size if g < len(self.small) else self.size - self.others.size

    def positions(self, g: int, ranks: np.ndarray) -> np.ndarray:
        """Chunk-local positions of the members of class g with these ranks."""
        if g < len(self.small):
            return self.small[g][ranks]
        below = self.others - np.arange(self.others.size)  # last-class elements before each
        return ranks + np.searchsorted(below, ranks, side="right")

    def changes(self, g: int, diff: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ranks, chunk-local positions) of the members of class g where diff != 0."""
        if g < len(self.small):
            hit = np.flatnonzero(diff[self.small[g]])
            return hit, self.small[g][hit]
        changed = np.flatnonzero(diff)
        if self.others.size == 0:
            return changed, changed
        slot = np.searchsorted(self.others, changed)
        inside = self.others[np.minimum(slot, self.others.size - 1)] != changed
        return changed[inside] - slot[inside], changed[inside]


def walk_classes(
    bits: np.ndarray, thresholds: tuple[int, ...], mask: int | None, crossers: np.ndarray
) -> Iterator[tuple[int, ChunkClasses]]:
    """Per chunk of `bits`: its start and its classes; crossers belong to no class."""
    for start in range(0, bits.size, CHUNK):
        chunk = bits[start : start + CHUNK]
        if not thresholds or mask is None:
            yield start, ChunkClasses(chunk.size, [], np.empty(0, np.int64))
            continue
        lo, hi = np.searchsorted(crossers, [start, start + CHUNK])
        cross = crossers[lo:hi] - start
        outside = (chunk & chunk.dtype.type(mask)) < chunk.dtype.type(thresholds[-1])
        outside[cross] = True
        others = np.flatnonzero(outside)
        ctx = classes_of(chunk[others], thresholds[:-1], mask)
        ctx[np.searchsorted(others, cross)] = len(thresholds)  # no class
        yield start, ChunkClasses(chunk.size, _group(others, ctx, len(thresholds)), others)


def _group(others: np.ndarray, ctx: np.ndarray, classes: int) -> list[np.ndarray]:
    """Members of each small class: one stable counting sort (radix for uint8 keys)."""
    if classes == 1:
        return [others[ctx == 0]]
    order = others[np.argsort(ctx, kind="stable")]
    bounds = np.cumsum(np.bincount(ctx, minlength=classes + 1))
    return np.split(order, bounds[:classes])[:classes]
