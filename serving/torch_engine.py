"""The torch backend: a Hugging Face causal LM on CPU (or one GPU), one model-owning thread.

All model work runs on a single worker thread, so requests never fight over the weights;
the asyncio side only submits requests and awaits results. Each request runs a prefill and
then incremental decode steps against a KV cache.

    engine = TorchEngine.load(Path("data/models/base"), version_number=0)
    result = await engine.generate(GenerationRequest(prompt_token_ids=[...], max_tokens=32))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
from pathlib import Path
from typing import Any

import torch

from kernels.weights import state_dict_sha256
from serving.engine import EngineError, GenerationRequest, GenerationResult, ModelVersion
from serving.sampling import sample_next, top_alternatives


class TorchEngine:
    """Generates with a transformers model; `version` names the weights it serves."""

    def __init__(self, model: Any, tokenizer: Any, *, version_number: int = 0,
                 seed: int = 0) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._version = ModelVersion(version_number, state_dict_sha256(model.state_dict()))
        self._rng = random.Random(seed)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._eos_ids = {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id)
                         if i is not None}

    @classmethod
    def load(cls, model_dir: Path, *, version_number: int = 0, seed: int = 0,
             threads: int | None = None) -> TorchEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        if threads:
            torch.set_num_threads(threads)
        if not (model_dir / "config.json").exists():
            raise EngineError(f"no Hugging Face model in {model_dir} (run `flywheel init-model`)")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return cls(model, tokenizer, version_number=version_number, seed=seed)

    @property
    def version(self) -> ModelVersion:
        return self._version

    @property
    def max_context(self) -> int:
        return int(self.model.config.max_position_embeddings)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, self.generate_sync, request)

    def generate_sync(self, request: GenerationRequest) -> GenerationResult:
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise EngineError("prompt is empty")
        if len(prompt) + request.max_tokens > self.max_context:
            raise EngineError(f"prompt ({len(prompt)}) + max_tokens ({request.max_tokens}) "
                              f"exceeds the context ({self.max_context})")
        seed = request.seed if request.seed is not None else self._rng.getrandbits(63)
        generator = torch.Generator().manual_seed(seed)
        stop_ids = self._eos_ids | set(request.stop_token_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        alternatives: list[list[tuple[int, float]]] = []
        finish = "length"
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
            for _ in range(request.max_tokens):
                token, logprob, dist = sample_next(out.logits[0, -1],
                                                   temperature=request.temperature,
                                                   top_p=request.top_p, generator=generator)
                tokens.append(token)
                logprobs.append(logprob)
                alternatives.append(top_alternatives(dist, request.top_logprobs))
                if token in stop_ids or self._hit_stop_string(tokens, request.stop):
                    finish = "stop"
                    break
                out = self.model(input_ids=torch.tensor([[token]]),
                                 past_key_values=out.past_key_values, use_cache=True)
        return GenerationResult(
            token_ids=tokens, logprobs=logprobs, finish_reason=finish,  # type: ignore[arg-type]
            version=self._version, text=self.decode(tokens),
            top_logprobs=alternatives if request.top_logprobs else [])

    def _hit_stop_string(self, tokens: list[int], stop: Any) -> bool:
        if not stop:
            return False
        tail = self.decode(tokens[-16:])
        return any(s in tail for s in stop)

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
