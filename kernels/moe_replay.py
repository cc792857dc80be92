"""MoE router capture and replay: the trainer reuses the experts that inference chose.

Serving records, for every token it feeds to the model, the top-k expert indices of every MoE
layer: int16, (tokens, num_moe_layers, top_k). The trainer replays them: the indices come from
the record, the gate weights are recomputed from the trainer's own router logits (softmax over
all experts, gathered at the recorded indices, renormalised when the router normalises its
top-k; with the same ops as the router's own forward, batch-invariant or stock), so the router
still receives gradient through the weights, and replaying the routes a router chose itself
reproduces its output bit for bit.

Both work on transformers' top-k routers (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral), modules whose
forward maps hidden (N, H) to (logits (N, E), weights (N, K), indices (N, K)). They use forward
hooks on those modules, so they compose with the stock or the batch-invariant forward.

    with capture_routes(model) as rec:
        model(input_ids=ids, attention_mask=mask)      # prefill, then decode steps...
    per_row = rec.sequences()                           # list of (T_b, L, K) int16
    with replay_routes(model, stack_routes(per_row, length=T)):
        logits = model(input_ids=ids, attention_mask=mask).logits
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from kernels.batch_invariant import is_batch_invariant, is_topk_router
from kernels.bi_ops import bi_row_sum, bi_softmax

NO_ROUTE = -1  # in a replay tensor: no record for this token/layer, the router chooses itself


class RouteShapeError(ValueError):
    """A replay tensor does not line up with the tokens or the routers of the forward."""


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of ``model`` in layer order; their position is the route's layer index."""
    return [m for m in model.modules() if is_topk_router(m)]


def _forward_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int, torch.Tensor]:
    """(batch, new tokens, valid (B, T) bool) of one model call, valid False at padding."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    tokens = ids if ids is not None else kwargs["inputs_embeds"][..., 0]
    batch, length = tokens.shape[:2]
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return batch, length, mask[:, -length:].bool().cpu()
    return batch, length, torch.ones(batch, length, dtype=torch.bool)


@dataclass(frozen=True)
class StepRoutes:
    """Routes of one model call. routes (B, T, L, K) int16; valid (B, T) bool, False at padding."""

    routes: torch.Tensor
    valid: torch.Tensor


class RouteRecorder:
    """Collects the experts chosen in each model call (a prefill or a decode step)."""

    def __init__(self, num_layers: int, top_k: int) -> None:
        self.num_layers, self.top_k = num_layers, top_k
        self.steps: list[StepRoutes] = []
        self._shape: tuple[int, int, torch.Tensor] | None = None
        self._layers: list[torch.Tensor | None] = []

    def _begin(self, batch: int, length: int, valid: torch.Tensor) -> None:
        self._shape = (batch, length, valid)
        self._layers = [None] * self.num_layers

    def _record(self, layer: int, indices: torch.Tensor) -> None:
        if self._shape is not None:
            self._layers[layer] = indices.detach().to("cpu", torch.int16)

    def _end(self) -> None:
        if self._shape is None or any(x is None for x in self._layers):
            return
        batch, length, valid = self._shape
        routes = torch.stack(self._layers, dim=1)  # type: ignore[arg-type]  # (B*T, L, K)
        self.steps.append(StepRoutes(routes.view(batch, length, self.num_layers, -1), valid))
        self._shape = None

    def pop_step(self) -> StepRoutes:
        """The latest call's routes, removed; for engines whose batch changes between steps."""
        return self.steps.pop()

    def sequences(self) -> list[torch.Tensor]:
        """Per batch row, (T_b, L, K) int16 over all recorded calls, one entry per real token.

        Needs the same batch rows in every call (prefill then decode steps of a static batch).
        """
        if not self.steps:
            return []
        rows = self.steps[0].routes.shape[0]
        if any(s.routes.shape[0] != rows for s in self.steps):
            raise RouteShapeError("batch size changed between calls; use pop_step() per call")
        return [torch.cat([s.routes[b][s.valid[b]] for s in self.steps]) for b in range(rows)]


@contextmanager
def capture_routes(model: nn.Module) -> Iterator[RouteRecorder]:
    """Record the routers' top-k indices of every forward of ``model`` inside the block."""
    routers = find_routers(model)
    if not routers:
        raise RouteShapeError(f"{type(model).__name__} has no top-k MoE router")
    top_k: Any = routers[0].top_k
    recorder = RouteRecorder(len(routers), int(top_k))

    def begin(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        recorder._begin(*_forward_shape(args, kwargs))

    handles = [model.register_forward_pre_hook(begin, with_kwargs=True)]
    for layer, router in enumerate(routers):
        handles.append(router.register_forward_hook(_capture_hook(recorder, layer)))
    handles.append(model.register_forward_hook(lambda *_: recorder._end()))
    try:
        yield recorder
    finally:
        for h in handles:
            h.remove()


def _capture_hook(recorder: RouteRecorder, layer: int) -> Any:
    def hook(_m: nn.Module, _args: Any, output: tuple[torch.Tensor, ...]) -> None:
        recorder._record(layer, output[2])

    return hook


def replay_gate_weights(
    logits: torch.Tensor, indices: torch.Tensor, normalize: bool, invariant: bool = True
) -> torch.Tensor:
    """Gate weights at given experts from the router's own logits. (N, E), (N, K) -> (N, K) fp32.

    Same math as the routers: softmax over all experts in float32, gathered, renormalised; with
    the batch-invariant ops (``invariant``, as the switched router) or torch's (as transformers'
    routers). On CPU both give the same bits; on CUDA the batch-invariant ones are the Triton
    kernels, whose bits differ from torch's, so each mode must use its router's own ops.
    """
    if invariant:
        probs = bi_softmax(logits, dim=-1)  # (N, E)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights = probs.gather(-1, indices)
    if normalize:
        weights = weights / (bi_row_sum(weights) if invariant else weights.sum(-1, keepdim=True))
    return weights


class RouteReplayer:
    """Holds the routes a replayed forward must use; ``routes`` may be swapped between calls."""

    def __init__(self, routes: torch.Tensor, num_layers: int) -> None:
        self.num_layers = num_layers
        self.routes = routes

    def indices(self, layer: int, tokens: int, device: torch.device) -> torch.Tensor:
        """Recorded indices of one layer as (N, K) int64, N = B*T in the forward's order."""
        if self.routes.dim() != 4 or self.routes.shape[2] != self.num_layers:
            raise RouteShapeError(f"routes must be (B, T, {self.num_layers}, K), got "
                                  f"{tuple(self.routes.shape)}")
        flat = self.routes.reshape(-1, self.num_layers, self.routes.shape[3])  # (B*T, L, K)
        if flat.shape[0] != tokens:
            raise RouteShapeError(f"routes cover {flat.shape[0]} tokens, the forward has {tokens}")
        return flat[:, layer].to(device=device, dtype=torch.long)


@contextmanager
def replay_routes(model: nn.Module, routes: torch.Tensor) -> Iterator[RouteReplayer]:
    """Force the recorded experts in every forward inside the block.

    routes (B, T, L, K) integer, aligned with the forward's input_ids (B, T); entries equal to
    ``NO_ROUTE`` (-1), e.g. padding or the final token, keep the router's own choice.
    """
    routers = find_routers(model)
    replayer = RouteReplayer(routes, len(routers))
    # prepend: replay rewrites the output before capture hooks see it, whatever the nesting order
    handles = [
        r.register_forward_hook(
            _replay_hook(replayer, i, lambda: is_batch_invariant(model)), prepend=True)
        for i, r in enumerate(routers)
    ]
    try:
        yield replayer
    finally:
        for h in handles:
            h.remove()


def _replay_hook(replayer: RouteReplayer, layer: int, invariant: Callable[[], bool]) -> Any:
    def hook(router: nn.Module, _args: Any, output: tuple[torch.Tensor, ...]) -> tuple:
        logits, own_weights, own = output
        recorded = replayer.indices(layer, logits.shape[0], logits.device)
        indices = torch.where(recorded >= 0, recorded, own)
        normalize = bool(getattr(router, "norm_topk_prob", True))  # Mixtral always normalises
        weights = replay_gate_weights(logits, indices, normalize, invariant())
        return logits, weights.to(own_weights.dtype), indices  # Mixtral keeps float32

    return hook


def stack_routes(
    sequences: Sequence[torch.Tensor], length: int, offsets: Sequence[int] | None = None
) -> torch.Tensor:
    """Place per-sequence routes (T_b, L, K) into a (B, length, L, K) int16 replay tensor.

    Sequence b starts at position ``offsets[b]`` (default 0: right padding); the rest is NO_ROUTE.
    """
    layers, top_k = sequences[0].shape[1:]
    out = torch.full((len(sequences), length, layers, top_k), NO_ROUTE, dtype=torch.int16)
    for b, seq in enumerate(sequences):
        start = offsets[b] if offsets is not None else 0
        out[b, start : start + seq.shape[0]] = seq[: length - start]
    return out


def stack_logged_routes(routes: Sequence[np.ndarray | None], width: int) -> torch.Tensor | None:
    """Per-row routes as logged ((tokens, L, K) int16, or None for a row logged without) as
    one (B, width, L, K) replay tensor, NO_ROUTE where a row has none (its router decides);
    None when no row has routes."""
    given = [r for r in routes if r is not None]
    if not given:
        return None
    empty = np.empty((0, *given[0].shape[1:]), dtype=np.int16)
    return stack_routes([torch.from_numpy(np.array(r if r is not None else empty, dtype=np.int16))
                         for r in routes], width)


class _NoReplay:
    routes: torch.Tensor | None = None


@contextmanager
def maybe_replay_routes(model: nn.Module, routes: torch.Tensor | None) -> Iterator[Any]:
    """``replay_routes`` with ``routes``, whose replayer's ``routes`` the calls inside may
    swap (a prefix, then the rest); without routes, a stand-in whose routes nothing reads."""
    if routes is None:
        yield _NoReplay()
        return
    with replay_routes(model, routes) as replayer:
        yield replayer
