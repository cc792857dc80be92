"""Float32 master weights for a model served in a lower dtype (bfloat16).

A replica serves the weights in the dtype its checkpoint names (`kernels.weights.served_dtype`).
Adam's steps at an online rate are far below bfloat16's resolution for most weights (8 bits of
mantissa: a weight of 0.02 moves in steps of 1.2e-4), so training the bfloat16 weights
themselves would round most updates away. Both trainers therefore keep float32 master weights
(what the optimizer steps and the checkpoint holds) and run the forward and backward on a copy
in the served dtype, so the logprobs they train on are those of the weights a replica serves
(bit for bit in the batch-invariant mode, where the engine and the copy run the same kernels):

    served = ServedCopy.of(master, torch.bfloat16)   # the copy, or the master itself in float32
    logp = forward(served.model, ...); loss.backward()
    served.gradients_to_master(); optimizer.step()   # the optimizer holds the master's params
    served.refresh()                                 # the copy: the master rounded to nearest

What a trainer publishes (a policy version, a release candidate, the KL reference) is the copy:
the served dtype's tensors, which deltas, hashes and hot-swaps are of. In float32 the copy is the
master (no second model, no cost).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch


def cast_parameters(model: Any, dtype: torch.dtype) -> Any:
    """`model` with its parameters in `dtype`, in place. Buffers keep their dtype, as in a model
    loaded in `dtype` (RoPE's inverse frequencies stay float32 there; rounded, every
    position's angle would move)."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


@dataclass
class ServedCopy:
    master: Any  # float32: the optimizer's and the checkpoint's weights
    model: Any  # the served dtype: forward, backward, published weights (the master in fp32)

    @classmethod
    def of(cls, master: Any, dtype: torch.dtype) -> ServedCopy:
        """`master` (float32, not sharded yet) and its copy in `dtype`."""
        if dtype == torch.float32:
            return cls(master, master)
        served = cast_parameters(copy.deepcopy(master), dtype)
        served.config.dtype = dtype  # what a worker built from this config loads it in
        return cls(master, served)

    @property
    def separate(self) -> bool:
        return self.model is not self.master

    def gradients_to_master(self) -> None:
        """Move the copy's gradients onto the master's parameters (upcast), clearing the copy's."""
        if not self.separate:
            return
        for master, served in zip(self.master.parameters(), self.model.parameters(),
                                  strict=True):
            master.grad = None if served.grad is None else served.grad.to(master.dtype)
            served.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """The copy becomes the master rounded to the served dtype (after a step or a load)."""
        if not self.separate:
            return
        for master, served in zip(self.master.parameters(), self.model.parameters(),
                                  strict=True):
            served.copy_(master)
