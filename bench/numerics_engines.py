"""The mismatch users of two engines face: samples from vLLM and from Flywheel's torch engine,
their logprobs recomputed by the trainer (the Hugging Face model, full-sequence forwards in
batches of another composition, no route replay: vLLM on CPU returns no routes).

Both engines serve the default model (built here) at temperature 1 with the same prompts, 32
of them at once, so each batches as it likes; vLLM reports `processed_logprobs` (after
temperature, what the trainer recomputes). Called by bench/numerics.py (`--engines`).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from pathlib import Path

import torch

PROMPTS, NEW_TOKENS = 32, 24


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(4, 24))] for _ in range(PROMPTS)]


def vllm_samples(model_dir: Path, batch: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    from vllm import LLM, SamplingParams

    from serving.vllm_engine import vllm_dtype

    llm = LLM(model=str(model_dir), dtype=vllm_dtype(model_dir), seed=0,
              kv_cache_memory_bytes=1 << 30, logprobs_mode="processed_logprobs")
    params = [SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, seed=i, logprobs=0,
                             ignore_eos=True) for i in range(len(batch))]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    samples = []
    for out in outs:
        choice = out.outputs[0]
        tokens = list(choice.token_ids)
        samples.append((tokens, [float(e[t].logprob)
                                 for t, e in zip(tokens, choice.logprobs, strict=True)]))
    return samples


def torch_samples(model_dir: Path, batch: list[list[int]]
                  ) -> list[tuple[list[int], list[float]]]:
    from serving.engine import GenerationRequest
    from serving.torch_engine import TorchEngine

    engine = TorchEngine.load(model_dir, max_batch=PROMPTS)

    async def all_at_once() -> list[tuple[list[int], list[float]]]:
        results = await asyncio.gather(*(engine.generate(GenerationRequest(
            prompt_token_ids=p, max_tokens=NEW_TOKENS, temperature=1.0, seed=i))
            for i, p in enumerate(batch)))
        return [(r.token_ids, r.logprobs) for r in results]

    try:
        return asyncio.run(all_at_once())
    finally:
        engine.close()


def recompute(model_dir: Path, batch: list[list[int]],
              samples: list[tuple[list[int], list[float]]]) -> dict[str, float]:
    """The trainer's logprobs of each sample (right-padded batches of 8, shuffled)."""
    from kernels.bi_ops import token_logprobs
    from trainer.release.weights import load_model

    model = load_model(model_dir)
    order = list(range(len(batch)))
    random.Random(1).shuffle(order)
    deltas = []
    for chunk in (order[i:i + 8] for i in range(0, len(order), 8)):
        seqs = [batch[i] + samples[i][0] for i in chunk]
        length = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), length, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(seqs):
            ids[b, :len(s)], mask[b, :len(s)] = torch.tensor(s), 1
        with torch.no_grad():
            lp = token_logprobs(model(input_ids=ids, attention_mask=mask).logits[:, :-1],
                                ids[:, 1:])
        for b, i in enumerate(chunk):
            start, n = len(batch[i]) - 1, len(samples[i][0])
            deltas.append((lp[b, start:start + n] - torch.tensor(samples[i][1])).abs())
    delta = torch.cat(deltas)
    return {"max_abs_dlogprob": float(delta.max()), "mean_abs_dlogprob": float(delta.mean()),
            "tokens_differing": float((delta > 0).float().mean()), "tokens": delta.numel()}


def run_engines() -> dict[str, dict[str, float]]:
    from app.settings import Settings
    from trainer.init_model import init_model

    settings = Settings()
    model_dir = init_model(settings.model, Path(tempfile.mkdtemp(prefix="numerics-")) / "base")
    batch = prompts(settings.model.vocab_size)
    result = {"torch_engine": recompute(model_dir, batch, torch_samples(model_dir, batch)),
              "vllm": recompute(model_dir, batch, vllm_samples(model_dir, batch))}
    for name, figures in result.items():
        print(f"  {name:12s} samples recomputed by the trainer: "
              + "  ".join(f"{k}={v:.3g}" for k, v in figures.items()), flush=True)
    return result
