"""Engine configuration owned by `serving` (composed into `app.settings.Settings`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class EngineSettings(BaseModel):
    """The inference engine: backend, limits and defaults."""

    backend: Literal["torch", "vllm"] = "torch"
    max_batch: int = Field(default=32, ge=1, le=1024)
    max_new_tokens_cap: int = Field(default=512, ge=1)
    default_max_tokens: int = Field(default=64, ge=1)
    # torch intra-op threads. None: `default_threads`, else torch's own default
    threads: int | None = Field(default=None, ge=1, description="torch intra-op threads")
    seed: int = 0
    # torch backend: keys/values of recent sequences kept for prompts that extend them (a
    # conversation's next turn). 0: off; excludes bitwise batch invariance (docs/serving.md)
    prefix_cache_tokens: int = Field(default=0, ge=0)
    # torch backend: compile the lean decode step (serving/decode.py) with torch.compile at
    # start-up (tens of seconds, less once inductor's cache is warm; eager where it fails):
    # ~2.5x the tokens/s of one request on the default model, none at 32 (docs/serving.md)
    compile: bool = True
    # vllm backend: memory for its KV cache. On a GPU, a fraction of GPU memory; on a CPU host
    # vLLM would reserve that fraction of *RAM* (0.92 by default), so there the cache is
    # sized in GiB instead (FLYWHEEL_ENGINE__VLLM_CPU_KV_CACHE_GIB).
    vllm_gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    vllm_cpu_kv_cache_gib: float = Field(default=1.0, gt=0)


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
