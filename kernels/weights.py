"""The identity of a set of weights: one deterministic sha256 over a state dict.

Serving reports it (`system_fingerprint`), releases record it, replicas verify it after a
hot-swap. Names are sorted; each tensor contributes its name, dtype, shape and raw bytes, so
two state dicts hash equal exactly when they are bit-identical.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def state_dict_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name]
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor_bytes(tensor))
    return digest.hexdigest()
