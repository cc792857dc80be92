"""The vLLM backend (GPU hosts): the same `Engine` protocol over vLLM's `AsyncLLM`.

vLLM does the continuous batching, paged KV cache and CUDA graphs; this adapter maps a
`GenerationRequest` to vLLM's `SamplingParams` and its delta outputs back to
`GenerationDelta`s, with what the session log needs:
- the sampled token's logprob (`logprobs=0`; `logprobs_mode="processed_logprobs"`, i.e. after
  temperature, which is what `serving.sampling` reports and the trainer recomputes);
- routed experts per position and MoE layer (`enable_return_routed_experts=True`, which needs
  the V2 model runner: `VLLM_USE_V2_MODEL_RUNNER=1`, set before vLLM is imported);
- with `batch_invariant=True`, vLLM's own batch-invariant kernels (`VLLM_BATCH_INVARIANT=1`, set
  before vLLM is imported; the torch backend's counterpart is kernels/batch_invariant.py);
- `swap_weights`: pause generation (requests in flight finish first), apply the caller's
  verified commit to a host copy of the HF state dict, load it into every worker in place
  (`collective_rpc` into `FlywheelWorkerExtension`), resume.

Imported only when `settings.engine.backend == "vllm"` (see `serving.backends.build_engine`);
nothing here imports vLLM at module import time. Written against vLLM 0.32's API.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from serving.engine import (
    EngineClosedError,
    EngineError,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    GenerationResult,
    ModelVersion,
    SwapTiming,
    TopLogprobs,
    collect,
)

if TYPE_CHECKING:
    from serving.config import EngineSettings

log = logging.getLogger(__name__)


class FlywheelWorkerExtension:
    """Mixed into vLLM's GPU workers (`worker_extension_cls`): in-place weight loading."""

    def flywheel_load_weights(self, named: dict[str, Any]) -> int:
        model = self.model_runner.model  # type: ignore[attr-defined]
        model.load_weights(weights=list(named.items()))
        return len(named)


def sampling_params(request: GenerationRequest, seed: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1, temperature=request.temperature, top_p=request.top_p,
        max_tokens=request.max_tokens, seed=seed, stop=list(request.stop) or None,
        stop_token_ids=list(request.stop_token_ids) or None,
        logprobs=request.top_logprobs,  # 0: the sampled token's logprob only
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
                         if lp.rank is not None and 1 <= lp.rank <= k])
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


class VllmEngine:
    """`Engine` over `vllm.v1.engine.async_llm.AsyncLLM`."""

    def __init__(self, llm: Any, tokenizer: Any, version: ModelVersion, *, model_dir: Path,
                 max_context: int, seed: int = 0) -> None:
        self._llm = llm
        self._model_dir = model_dir
        self._host_state: dict[str, Any] | None = None  # HF-named weights, for swaps
        self.tokenizer = tokenizer
        self._version = version
        self._max_context = max_context
        self._rng = random.Random(seed)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def load(cls, model_dir: Path, settings: EngineSettings, *, version_number: int = 0,
             sha256: str | None = None, gpu_memory_utilization: float = 0.85,
             batch_invariant: bool = False) -> VllmEngine:
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # routed experts need it
        if batch_invariant:  # read by vLLM at import and by its workers, which inherit it
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(model_dir), tokenizer=str(model_dir), dtype="auto", seed=settings.seed,
            max_num_seqs=settings.max_batch, gpu_memory_utilization=gpu_memory_utilization,
            enable_return_routed_experts=True, logprobs_mode="processed_logprobs",
            max_logprobs=20, worker_extension_cls=f"{__name__}.FlywheelWorkerExtension")
        llm = AsyncLLM.from_engine_args(args)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        version = ModelVersion(version_number, sha256 or _weights_sha256(model_dir))
        return cls(llm, tokenizer, version, model_dir=model_dir,
                   max_context=int(llm.model_config.max_model_len), seed=settings.seed)

    @property
    def version(self) -> ModelVersion:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    def _check(self, request: GenerationRequest) -> None:
        if self._closed:
            raise EngineClosedError("engine is closed")
        if not request.prompt_token_ids:
            raise EngineError("prompt is empty")
        if len(request.prompt_token_ids) + request.max_tokens > self._max_context:
            raise EngineError(f"prompt ({len(request.prompt_token_ids)}) + max_tokens "
                              f"({request.max_tokens}) exceeds the context "
                              f"({self._max_context})")

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Deltas from vLLM; closing the iterator aborts the request in vLLM."""
        self._check(request)
        self._loop = asyncio.get_running_loop()
        seed = request.seed if request.seed is not None else self._rng.getrandbits(31)
        request_id = f"fw-{uuid.uuid4().hex}"
        version = self._version  # swaps wait for requests in flight: one version per reply
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
                    result = GenerationResult(
                        token_ids=tokens, logprobs=logprobs, finish_reason=finish,
                        version=version, text=text, top_logprobs=tops,
                        routed_experts=routes_array(getattr(choice, "routed_experts", None),
                                                    rows))
                yield GenerationDelta(token_ids=new, logprobs=lps, text=choice.text,
                                      top_logprobs=alts, finish_reason=finish, result=result)
                if finished:
                    return
        finally:
            if not finished:
                await self._llm.abort(request_id)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await collect(self.stream(request))

    def swap_weights(self, commit: Callable[[MutableMapping[str, Any]], object],
                     version: ModelVersion) -> concurrent.futures.Future[SwapTiming]:
        """Pause generation (in-flight requests finish), run `commit` on the Hugging Face
        state dict this engine keeps on the host, load the result into every worker in
        place (vLLM maps HF names onto its fused layout), resume."""
        if self._loop is None:
            raise EngineError("swap_weights needs the engine's event loop (serve a request first)")
        return asyncio.run_coroutine_threadsafe(self._swap(commit, version), self._loop)

    async def _swap(self, commit: Callable[[MutableMapping[str, Any]], object],
                    version: ModelVersion) -> SwapTiming:
        requested = time.perf_counter()
        if self._host_state is None:
            self._host_state = _load_state(self._model_dir)
        await self._llm.pause_generation(wait_for_inflight_requests=True)
        try:
            started = time.perf_counter()
            commit(self._host_state)
            await self._llm.collective_rpc("flywheel_load_weights", args=(self._host_state,))
            await self._llm.reset_prefix_cache()  # cached KV was computed by the old weights
            self._version = version
        finally:
            await self._llm.resume_generation()
        done = time.perf_counter()
        return SwapTiming(paused_s=done - requested, copy_s=done - started)

    def close(self) -> None:
        self._closed = True
        self._llm.shutdown()


def _load_state(model_dir: Path) -> dict[str, Any]:
    """The Hugging Face state dict on disk (all safetensors shards), on the host."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def _weights_sha256(model_dir: Path) -> str:
    """The served version's sha256 over the weights on disk (same rule as the torch side;
    tied weights saved once hash once here)."""
    from kernels.weights import state_dict_sha256

    return state_dict_sha256(_load_state(model_dir))
