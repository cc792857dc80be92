"""`build_engine`: the backend `EngineSettings` names, and only that one imported (vLLM is
not installed on every host; the torch engine pulls in torch)."""

from __future__ import annotations

from pathlib import Path

from serving.config import DEFAULT_PREFIX_CACHE_TOKENS, EngineSettings
from serving.engine import Engine


def build_engine(settings: EngineSettings, model_dir: Path, *, version_number: int = 0,
                 batch_invariant: bool = False) -> Engine:
    """The backend `settings.backend` names; the other backend is never imported."""
    if settings.backend == "vllm":
        from serving.vllm_engine import VllmEngine

        return VllmEngine.load(model_dir, settings, version_number=version_number,
                               batch_invariant=batch_invariant)
    from serving.torch_engine import TorchEngine

    prefix_cache_tokens = settings.prefix_cache_tokens
    if prefix_cache_tokens is None:  # on by default, but never with bitwise batch invariance
        prefix_cache_tokens = 0 if batch_invariant else DEFAULT_PREFIX_CACHE_TOKENS

    return TorchEngine.load(model_dir, version_number=version_number, seed=settings.seed,
                            threads=settings.threads, max_batch=settings.max_batch,
                            batch_invariant=batch_invariant,
                            prefix_cache_tokens=prefix_cache_tokens,
                            compile=settings.compile, onednn=settings.onednn)
