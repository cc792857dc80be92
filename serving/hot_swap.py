"""Hot-swap of an engine that holds the weights in this process (the torch engine): a release
enters by the engine's `swap_to`, which prepares and verifies the target version off the
engine thread (`prepare_release`, with the codec of kernels/delta/state_dict.py) and hands the
commit to its own `BetweenSteps`, which runs it in place between decode steps once the requests
in flight have finished. (The vLLM engine runs the same `prepare_commit` inside its workers:
serving/vllm_worker.py.)

One delta step (the usual release, or a rollback: the same delta backwards) is prepared
against the live weights, read-only, and committed as the changed bit patterns: the pause is
that write. A longer chain or a snapshot (a replica far behind) is applied to a copy and
swapped in whole. Any failed check raises `DeltaError` before a live weight is touched.

A caller that knows the next version early (a rollout worker, while it makes a batch on the
current one) asks the engine to `prepare_swap` ahead and passes the result to `swap_to`
later: one way in, and this module never calls back into an engine.
"""

from __future__ import annotations

import abc
import concurrent.futures
import queue
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from kernels.delta import DeltaVerificationError, commit, prepare
from kernels.delta.chain import ChainStep, ReleaseInfo, apply_chain, plan_chain
from kernels.delta.store import ArtifactStore
from kernels.weights import state_dict_sha256
from serving.config import on_own_thread
from serving.engine import ModelVersion, SwapRecord, SwapTiming

Weights = MutableMapping[str, torch.Tensor]
Commit = Callable[[Weights], object]


@dataclass(frozen=True)
class _Swap:
    commit: Commit
    version: ModelVersion
    future: concurrent.futures.Future[SwapTiming]
    requested_at: float


class BetweenSteps:
    """Work other threads hand an in-place engine's thread, run between two decode steps:
    a `call` at the next one; a `swap` once the rows in flight have finished (the engine
    asks `swap_waiting()` before it admits requests and pauses admission while one waits),
    so no response mixes two versions."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake  # an idle engine thread waits for requests: wake it
        self._calls: queue.SimpleQueue[tuple[Callable[[Any], Any],
                                             concurrent.futures.Future[Any]]]
        self._calls = queue.SimpleQueue()
        self._swaps: queue.SimpleQueue[_Swap] = queue.SimpleQueue()
        self._next_swap: _Swap | None = None

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        """Any thread: `fn(model)` at the next step; its future gets what it returns."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls.put((fn, future))
        self._wake()
        return future

    def swap(self, commit: Commit, version: ModelVersion
             ) -> concurrent.futures.Future[SwapTiming]:
        """Any thread: queue a commit to `version`; its future gets the pause it cost."""
        future: concurrent.futures.Future[SwapTiming] = concurrent.futures.Future()
        self._swaps.put(_Swap(commit, version, future, time.perf_counter()))
        self._wake()
        return future

    def run_calls(self, model: Any, before: Callable[[], None]) -> None:
        """The engine thread: run every call handed so far, `before()` each (its weights may
        change); a call's exception goes to its future."""
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                before()
                try:
                    future.set_result(fn(model))
                except Exception as exc:  # handed to the caller through the future
                    future.set_exception(exc)

    def swap_waiting(self) -> bool:
        """The engine thread: whether a swap waits for the rows in flight."""
        if self._next_swap is None:
            try:
                self._next_swap = self._swaps.get_nowait()
            except queue.Empty:
                return False
        return True

    def commit_swap(self, weights: Weights, serve: Callable[[ModelVersion], None]) -> None:
        """The engine thread, with no row in flight: write the waiting swap into `weights`,
        then `serve(version)` before its future resolves. A failed commit goes to the
        future (its caller refuses the release) and the engine serves what it had."""
        swap, self._next_swap = self._next_swap, None
        assert swap is not None, "commit_swap() without a waiting swap"
        started = time.perf_counter()
        try:
            swap.commit(weights)
        except Exception as exc:  # handed to the caller, who refuses the release
            swap.future.set_exception(exc)
            return
        serve(swap.version)
        done = time.perf_counter()
        swap.future.set_result(SwapTiming(paused_s=done - swap.requested_at,
                                          copy_s=done - started))


def plan(store: ArtifactStore, current: ModelVersion, target: int) -> list[ChainStep]:
    return plan_chain(current.number, target, store.releases())


def prepare_commit(store: ArtifactStore, live: Weights, steps: list[ChainStep],
                   expected_sha256: str) -> Commit:
    """A verified commit that takes `live` to the plan's end; `live` is only read here."""
    def open_release(info: ReleaseInfo):  # type: ignore[no-untyped-def]
        return (store.read_manifest(info.version, info.kind),
                store.shard_reader(info.version, info.kind))

    if len(steps) == 1 and steps[0].release.kind == "delta":
        manifest, reader = open_release(steps[0].release)
        prepared = prepare(live, manifest, reader)
        if prepared.reaches.sha256 != expected_sha256:
            raise DeltaVerificationError(f"delta reaches {prepared.reaches.sha256[:12]}, the "
                                         f"release says {expected_sha256[:12]}")
        return lambda weights: commit(weights, prepared)
    shadow = {n: t.detach().clone() for n, t in live.items()}
    apply_chain(shadow, steps, open_release)
    reached = state_dict_sha256(shadow)
    if reached != expected_sha256:
        raise DeltaVerificationError(f"chain reaches {reached[:12]}, the release says "
                                     f"{expected_sha256[:12]}")

    def copy_in(weights: Weights) -> None:
        for name, tensor in shadow.items():
            weights[name].copy_(tensor)
    return copy_in


@dataclass(frozen=True)
class PreparedSwap:
    """A verified commit from `base` to `version`, ready to be written in between steps."""

    base: ModelVersion  # the live weights it was prepared against
    version: ModelVersion
    steps: int
    prepare_s: float
    write: Commit  # run on the engine thread, between decode steps
    live: Weights


def prepare_release(live: Weights, base: ModelVersion, store: ArtifactStore,
                    version: ModelVersion) -> PreparedSwap:
    """Plan and verify `version` against `live`, the weights of `base` (only read here)."""
    started = time.perf_counter()
    steps = plan(store, base, version.number)
    write = on_own_thread(  # torch work: keep the caller's thread free of an OpenMP pool
        lambda: prepare_commit(store, live, steps, version.sha256))
    return PreparedSwap(base, version, len(steps), time.perf_counter() - started, write, live)


def swap_record(prepared: PreparedSwap, timing: SwapTiming) -> SwapRecord:
    """What a swap did and cost, with the live weights' hash read after it."""
    return SwapRecord(prepared.version.number, prepared.version.sha256, prepared.steps,
                      prepared.prepare_s, timing.paused_s, timing.copy_s,
                      state_dict_sha256(prepared.live), time.time())


class InPlaceEngine(abc.ABC):
    """The hot-swap side of an engine whose weights live in this process (the torch engine
    inherits it, and its thread runs `between`'s work between decode steps): a release is
    prepared against the live weights, now or ahead, then written in by `swap_to`."""

    between: BetweenSteps

    @property
    @abc.abstractmethod
    def version(self) -> ModelVersion:
        """The version the engine serves."""

    def call_between_steps(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn(model)` on the engine thread between two decode steps."""
        return self.between.call(fn)

    def swap_weights(self, commit: Commit, version: ModelVersion
                     ) -> concurrent.futures.Future[SwapTiming]:
        """Run `commit(live_state_dict)` (verified writes) and serve `version` from then on:
        admission pauses until the requests in flight finish, so no reply mixes versions."""
        return self.between.swap(commit, version)

    def live_weights(self, timeout_s: float = 120.0) -> Weights:
        """The model's state dict (tensors sharing its storage); only swaps write to them."""
        return self.call_between_steps(  # type: ignore[no-any-return]
            lambda model: model.state_dict()).result(timeout_s)

    def prepare_swap(self, store: ArtifactStore, version: ModelVersion, *,
                     live: Weights | None = None, timeout_s: float = 120.0) -> PreparedSwap:
        """`version` planned and verified against the live weights (`live`: the state dict, if
        the caller holds it), read while serving goes on: for `swap_to` now or later."""
        live = self.live_weights(timeout_s) if live is None else live
        return prepare_release(live, self.version, store, version)

    def swap_to(self, store: ArtifactStore, version: ModelVersion, *,
                prepared: PreparedSwap | None = None, timeout_s: float = 120.0) -> SwapRecord:
        """A release into this engine: `prepared` where it was prepared against the weights
        served now (else it is prepared here), written in once the requests in flight end."""
        if prepared is None or (prepared.base, prepared.version) != (self.version, version):
            prepared = self.prepare_swap(store, version, timeout_s=timeout_s)
        timing = self.swap_weights(prepared.write, version).result(timeout_s)
        return swap_record(prepared, timing)
