"""`xor` and `full`: a tensor's bit patterns as byte planes (all the low bytes, then the next,
...), each a zstd frame, so that the exponent bytes compress apart from the noisy mantissa's.
`xor` codes base ^ target (self-inverse by construction), `full` the target itself (snapshots).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernels.delta.streams import CorruptStreamError, compress, decompress


def encode_planes(bits: np.ndarray, level: int, threads: int) -> list[bytes]:
    """Byte planes (all low bytes, then the next ...): exponent bytes compress apart."""
    width = bits.dtype.itemsize
    planes = bits.view(np.uint8).reshape(-1, width).T
    return [compress(np.ascontiguousarray(p), level, threads) for p in planes]


def decode_planes(frames: Sequence[memoryview], live: np.ndarray) -> np.ndarray:
    width = live.dtype.itemsize
    if len(frames) != width:
        raise CorruptStreamError(f"{len(frames)} byte planes for {width}-byte elements")
    out = np.empty((live.size, width), np.uint8)
    for j, frame in enumerate(frames):
        plane = decompress(frame, np.uint8)
        if plane.size != live.size:
            raise CorruptStreamError(f"byte plane of {plane.size} for {live.size} elements")
        out[:, j] = plane
    return out.reshape(-1).view(live.dtype)
