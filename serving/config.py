"""Engine configuration owned by `serving` (composed into `app.settings.Settings`)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field

T = TypeVar("T")


class EngineSettings(BaseModel):
    """The inference engine: backend, limits and defaults."""

    backend: Literal["torch", "vllm"] = "torch"
    max_batch: int = Field(default=32, ge=1, le=1024)
    max_new_tokens_cap: int = Field(default=512, ge=1)
    default_max_tokens: int = Field(default=64, ge=1)
    # torch intra-op threads. None: `default_threads`, else torch's own default
    threads: int | None = Field(default=None, ge=1, description="torch intra-op threads")
    seed: int = 0
    # how the model writes a function call (app/api/tool_calls.py): qwen3_coder (XML, the default
    # model's template), hermes (JSON in <tool_call> tags: Qwen2.5/Qwen3, Hermes)
    tool_parser: Literal["qwen3_coder", "hermes"] = "qwen3_coder"
    # torch backend: keys/values of recent sequences kept for prompts that extend them (a
    # conversation's next turn, the same prompt again), in tokens. None: DEFAULT_PREFIX_CACHE_
    # TOKENS, or off with bitwise batch invariance, which it excludes; 0: off (docs/serving.md)
    prefix_cache_tokens: int | None = Field(default=None, ge=0)
    # torch backend, float32 on a CPU: the lean step's GEMMs on oneDNN copies of the weights
    # (serving.onednn.OneDnnWeights). auto: where a model of SMALL_MODEL_PARAMS or more gets
    # them faster than from torch's BLAS on this host, measured at load (1.6-1.8x on an AMD
    # EPYC host; slower on an Intel Xeon one, whose MKL is already fast)
    onednn: Literal["auto", "on", "off"] = "auto"
    # torch backend: compile the lean decode step (serving/decode.py) with torch.compile at
    # start-up (tens of seconds, less once inductor's cache is warm; eager where it fails):
    # ~2.5x the tokens/s of one request on the default model, none at 32 (docs/serving.md)
    compile: bool = True
    # vllm backend: memory for its KV cache. On a GPU, a fraction of GPU memory; on a CPU host
    # vLLM would reserve that fraction of *RAM* (0.92 by default), so there the cache is
    # sized in GiB instead (FLYWHEEL_ENGINE__VLLM_CPU_KV_CACHE_GIB).
    vllm_gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    vllm_cpu_kv_cache_gib: float = Field(default=1.0, gt=0)
    # vllm backend: vLLM's `enforce_eager` (no torch.compile, no CUDA graphs): starts in less
    # than half the time (tiny Mixtral on 2 CPU cores: 20 s against 47 s) and decodes slower;
    # for tests and debugging
    vllm_enforce_eager: bool = False


# The torch engine's prefix cache when settings leave it unset (as vLLM's server caches prefixes
# by default): ~64 MB of keys/values for the default model, ~200 MB for the ~124M one.
DEFAULT_PREFIX_CACHE_TOKENS = 32768


# Below this many parameters a CPU decode step is hundreds of tiny ops: splitting each over
# threads costs more than it saves (the default 2.3M model on 2 cores: ~4,000 tok/s at c=32 on
# one thread, ~2,000 on two), while a 124M model gains from torch's default of every physical
# core (290 -> 374 tok/s on two).
SMALL_MODEL_PARAMS = 20_000_000


def default_threads(model: Any) -> int | None:
    """Intra-op threads for serving `model` with the torch engine: one for a small model on
    CPU; None (leave torch's default) otherwise."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    small = sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS
    return 1 if on_cpu and small else None


def on_own_thread(fn: Callable[[], T]) -> T:
    """`fn()` run on a new thread that ends when it returns; its result, or its exception.

    For heavy torch work (loading a model, preparing a swap) in a process whose engine thread
    runs torch's intra-op threads. torch's OpenMP (libgomp) gives each thread that runs a
    parallel region a pool of workers that lives as long as that thread, and while more such
    workers exist than CPUs, every pool's workers sleep between regions instead of
    spin-waiting for the next: each of the hundreds of small parallel ops of a decode step
    then pays for waking them. Measured on 2 cores: the ~124M model's compiled one-row step,
    8 ms on an engine thread alone, 13 ms once the main thread had run one parallel op. A
    thread that ends takes its pool with it.
    """
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torch-work") as pool:
        return pool.submit(fn).result()  # leaving the block joins the thread
