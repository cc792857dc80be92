"""The identity of a set of weights: one deterministic sha256 over a state dict.

Serving reports it (`system_fingerprint`), releases record it, replicas verify it after a
hot-swap. Names are sorted; each tensor contributes its name, dtype, shape and raw bytes, so
two state dicts hash equal exactly when they are bit-identical. Weights are served in the dtype
their checkpoint names (`served_dtype`): float32 or bfloat16.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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


# The dtypes Flywheel serves and ships weights in. The trainers keep float32 master weights
# whatever the served dtype (trainer/precision.py).
SERVED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def served_dtype(config: Any) -> torch.dtype:
    """The dtype a checkpoint is served in: the one its Hugging Face config names (`dtype`,
    `torch_dtype` before transformers 5), float32 where it names none."""
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    name = str(name).removeprefix("torch.")
    if name not in SERVED_DTYPES:
        raise ValueError(f"the checkpoint's dtype is {name}; Flywheel serves "
                         f"{' or '.join(SERVED_DTYPES)} (save it in one of them)")
    return SERVED_DTYPES[name]


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    """`served_dtype` of the Hugging Face model directory `model_dir`."""
    from transformers import AutoConfig

    return served_dtype(AutoConfig.from_pretrained(model_dir))
