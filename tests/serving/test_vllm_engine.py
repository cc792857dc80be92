"""The vLLM backend: import-safe without vLLM, its output mapping on CPU, the engine on GPU."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from app.settings import Settings
from serving.config import EngineSettings
from serving.engine import GenerationRequest, GenerationResult
from serving.vllm_engine import VllmEngine, routes_array, token_logprobs


@dataclass
class Logprob:  # vLLM's per-token logprob record, as the adapter reads it
    logprob: float
    rank: int | None


def test_module_imports_without_vllm() -> None:
    assert "vllm" not in sys.modules or sys.modules["vllm"] is not None


def test_logprob_entries_map_to_sampled_and_top_k() -> None:
    entries = [{5: Logprob(-0.5, 2), 9: Logprob(-0.1, 1), 3: Logprob(-2.0, 3)},
               {7: Logprob(-1.0, 1)}]
    sampled, tops = token_logprobs([5, 7], entries, 2)
    assert sampled == [-0.5, -1.0]
    assert tops == [[(9, -0.1), (5, -0.5)], [(7, -1.0)]]
    assert token_logprobs([5, 7], entries, 0) == ([-0.5, -1.0], [])


def test_tokens_a_grammar_masked_are_no_alternatives() -> None:
    entries = [{4: Logprob(0.0, 1), 0: Logprob(-math.inf, 2)}]  # a forced token
    assert token_logprobs([4], entries, 2) == ([0.0], [[(4, 0.0)]])


def test_routes_are_trimmed_to_the_positions_fed() -> None:
    raw = np.arange(5 * 4 * 2).reshape(5, 4, 2)
    assert routes_array(raw, 4).shape == (4, 4, 2)
    assert routes_array(raw, 4).dtype == np.int16
    assert routes_array(raw, 6) is None and routes_array(None, 3) is None


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vLLM is installed: load would start it")
@pytest.mark.parametrize("on", [True, False])
def test_batch_invariant_is_in_the_environment_before_vllm_is_imported(
        on: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ImportError, match="vllm"):  # load got as far as importing vLLM
        VllmEngine.load(tmp_path, EngineSettings(backend="vllm"), batch_invariant=on)
    assert os.environ.get("VLLM_BATCH_INVARIANT") == ("1" if on else None)


@pytest.mark.gpu
def test_vllm_engine_generates_with_logprobs_and_routes(model_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    from serving.vllm_engine import VllmEngine

    engine = VllmEngine.load(model_dir, Settings(engine={"backend": "vllm",
                                                          "vllm_gpu_memory_utilization": 0.3}
                                                  ).engine)
    request = GenerationRequest(prompt_token_ids=[5, 6, 7, 8], max_tokens=8, temperature=0.8,
                                seed=1)

    async def twice() -> tuple[GenerationResult, GenerationResult]:  # one loop: vLLM's
        return await engine.generate(request), await engine.generate(request)

    try:
        result, again = asyncio.run(twice())
        assert len(result.logprobs) == len(result.token_ids) >= 1
        assert result.routed_experts is not None and result.routes_absent is None
        assert result.routed_experts.shape[0] == 4 + len(result.token_ids) - 1
        assert again.token_ids == result.token_ids
    finally:
        engine.close()
