"""A trainer over N ranks: torch.distributed, FSDP2 and how a process joins or starts a world.

`World` says where this process stands (rank, size, device). `join_world` opens the process
group when the process runs under torchrun (or `launch`), else it is the one-process world and
nothing distributed happens. `shard` wraps a Hugging Face causal LM with FSDP2
(`fully_shard` per decoder block, then at the root, on a 1-D device mesh): parameters,
gradients and the optimizer's state are each 1/N per rank, and the block's full weights exist
only while it runs. `full_state_dict` gathers the weights tensor by tensor to the leader's CPU
(a release, a candidate), so no rank holds two full copies. `launch` starts N local ranks
under torch's elastic agent: when one rank dies the agent stops the others within
`monitor_interval` and starts the world again, up to `max_restarts` times; each start resumes
from the last checkpoint.

    flywheel train-online --nproc 2                  # N local ranks (gloo on CPU, NCCL on GPU)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        -m app.cli train-online                      # many hosts
"""

from __future__ import annotations

import functools
import os
import pickle
import socket
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

R = TypeVar("R")


@dataclass(frozen=True)
class World:
    """This process's place among the trainer's ranks; `World()` is the one-process world."""

    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sharded: bool = False  # a process group is up and models are wrapped with FSDP2

    @property
    def leader(self) -> bool:
        """Rank 0: reads Kafka, writes the checkpoint's state and ledger, ships releases."""
        return self.rank == 0

    def broadcast(self, obj: Any = None) -> Any:
        """The leader's `obj` on every rank (identity in the one-process world)."""
        if not self.sharded:
            return obj
        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0, device=_object_device(self.device))
        return box[0]

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise sum of `values` over ranks (a CPU float tensor in, the same out)."""
        if not self.sharded:
            return values
        out = values.to(self.device)
        dist.all_reduce(out)
        return out.cpu()

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier()

    def loss_share(self, mine: float, total: float) -> float:
        """What a rank's loss, a mean over its `mine` of the batch's `total` (tokens or rows),
        is scaled by, so that FSDP's mean of the ranks' gradients is the gradient of the mean
        over the whole batch (1.0 in the one-process world, where mine == total)."""
        return mine / max(total, 1.0) * self.size

    def batch_means(self, local: dict[str, float], weight: float) -> dict[str, float]:
        """Metrics over the whole batch from each rank's, over its share `weight` of it: means
        weighted by the shares, and the maximum of those named `max_*`."""
        if not self.sharded:
            return local
        means = [k for k in local if not k.startswith("max_")]
        sums = self.all_sum(torch.tensor([local[k] * weight for k in means] + [weight],
                                         dtype=torch.float64)).tolist()
        total = max(sums.pop(), 1.0)
        out = {k: v / total for k, v in zip(means, sums, strict=True)}
        maxima = [k for k in local if k.startswith("max_")]
        if maxima:
            top = torch.tensor([local[k] for k in maxima], dtype=torch.float64).to(self.device)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            out |= dict(zip(maxima, top.tolist(), strict=True))
        return out


class Phases:
    """The leader's collective phases, mirrored on every rank.

    A method decorated `@collective` is a phase: every rank must run it, in the same order.
    On the leader of a sharded world, entering a phase first broadcasts its name and arguments
    (positional, picklable); the other ranks sit in `follow`, which calls the same method of
    their own object. A phase that calls another runs it as part of itself (announced once).
    In the one-process world nothing is sent."""

    def __init__(self, world: World) -> None:
        self.world = world
        self._depth = 0

    @contextmanager
    def enter(self, name: str, args: tuple[Any, ...]) -> Iterator[None]:
        if self.world.sharded and self.world.leader and self._depth == 0:
            self.world.broadcast((name, args))
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def follow(self, target: Any) -> None:
        """A rank other than the leader: run each phase the leader enters, on `target`, until
        `finish`. A leader that died leaves this rank in a collective that times out."""
        while True:
            name, args = self.world.broadcast()
            if name == "finish":
                return
            if name != "tick":
                getattr(target, name)(*args)

    def tick(self) -> None:
        """Nothing to do this round; tells the other ranks the leader is alive."""
        with self.enter("tick", ()):
            pass

    def finish(self) -> None:
        """The leader is done: the other ranks leave `follow`."""
        with self.enter("finish", ()):
            pass


def collective(method: Callable[..., R]) -> Callable[..., R]:
    """Mark a method of an object with a `phases: Phases` attribute as a phase (see Phases)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any) -> R:
        with self.phases.enter(method.__name__, args):
            return method(self, *args)

    return run


def _object_device(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


def join_world(*, timeout_s: float = 300.0, cpu: bool = False) -> World:
    """Open the process group when launched by torchrun or `launch`, else the one-process world
    (which trains on the CPU). Ranks use NCCL and a GPU each where CUDA is, else gloo on the
    CPU (`cpu`: gloo on the CPU regardless).

    A collective that waits longer than `timeout_s` (a rank died, a host is gone) raises, so a
    rank never hangs forever on a dead peer."""
    if not dist.is_torchelastic_launched():
        return World()
    cuda = torch.cuda.is_available() and not cpu
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return World(rank=rank, size=size, device=device, sharded=True)


def leave_world(world: World) -> None:
    if world.sharded and dist.is_initialized():
        dist.destroy_process_group()


def shard(model: Any, world: World) -> Any:
    """FSDP2: each decoder block is one unit of all-gather and reduce-scatter, the root (the
    embeddings, the final norm, the tied LM head) another. A model still on the CPU moves to
    `world.device` block by block, each keeping its shard: the whole model is never on one
    device. Returns the same module."""
    if not world.sharded:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state_dict(model: Any, world: World) -> dict[str, torch.Tensor]:
    """The whole model's weights on the leader's CPU ({} on the other ranks): gathered one
    tensor at a time, each a copy that nothing else holds (safe to hand to another thread)."""
    if not world.sharded:
        return {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in get_model_state_dict(model, options=options).items():
        assert isinstance(tensor, torch.Tensor), name  # a model's state: tensors only
        # tied weights (embeddings and LM head) are one tensor: each name gets its own
        weights[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    return weights


def load_full_state_dict(model: Any, weights: Mapping[str, Any], world: World) -> None:
    """Every rank passes the same full weights; each keeps its own shard of them."""
    if not world.sharded:
        model.load_state_dict(weights)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):  # the root keeps its parameters gathered after a
        model.reshard()  # forward (for the backward), as a reference's forward leaves them
    set_model_state_dict(model, dict(weights), options=StateDictOptions(full_state_dict=True))


def grad_norm(model: Any, max_norm: float) -> float:
    """Clip the gradients to `max_norm` (over all ranks' shards); the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    full = getattr(norm, "full_tensor", None)  # a DTensor when the gradients are sharded
    return float(full() if full is not None else norm)


# ---- starting N local ranks -----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(nproc: int, entrypoint: Callable[..., Any], *args: Any, max_restarts: int = 3,
           monitor_interval_s: float = 0.5) -> dict[int, Any]:
    """Run `entrypoint(*args)` on `nproc` local ranks under torch's elastic agent (what
    torchrun runs); returns each rank's return value. `entrypoint` and `args` must pickle."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    pickle.dumps((entrypoint, args))  # fail here, not inside a spawned rank
    # Each start of the ranks gets a store of its own rather than the agent's shared one:
    # ranks SIGKILLed while they joined it left it refusing the next start's ranks (seen
    # here, torch 2.13, in tests/integration/test_online_chaos_sharded.py).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"flywheel-{uuid.uuid4().hex}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=max_restarts, monitor_interval=monitor_interval_s, start_method="spawn",
        local_addr="127.0.0.1")
    return elastic_launch(config, entrypoint)(*args)
