"""Real inputs for the trainers' tests: experiences sampled from the tiny model (tokens, logprobs,
MoE routes) and trainer checkpoints (seeded noise on its weights)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch

from ingest.events import ExperienceReady, PackedArray, SamplingParams, experience_id_for, utcnow
from trainer.release.weights import (
    load_model,
    save_weights,
)

PROMPTS = ["def add(a, b):", "Write a function that reverses a string.", "def is_even(n):"]


def make_experiences(model_dir: Path, count: int, *, seed: int = 0, max_tokens: int = 6,
                     temperature: float = 1.0) -> list[ExperienceReady]:
    """Real records: tokens sampled from the tiny model, their logprobs and MoE routes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 7x faster than 2 oversubscribed threads on a shared CPU
    try:
        return _sample_experiences(model_dir, count, seed=seed, max_tokens=max_tokens,
                                   temperature=temperature)
    finally:
        torch.set_num_threads(threads)


def _sample_experiences(model_dir: Path, count: int, *, seed: int, max_tokens: int,
                        temperature: float) -> list[ExperienceReady]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kernels.moe_replay import capture_routes

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = tok(PROMPTS[i % len(PROMPTS)])["input_ids"]
        ids, logprobs = list(prompt), []
        with torch.no_grad():
            step = model(input_ids=torch.tensor([ids]), use_cache=True)
            for _ in range(max_tokens):
                probs = torch.softmax(step.logits[0, -1] / temperature, -1)
                token = int(torch.multinomial(probs, 1, generator=gen))
                logprobs.append(float(torch.log(probs[token])))
                ids.append(token)
                step = model(input_ids=torch.tensor([[token]]), use_cache=True,
                             past_key_values=step.past_key_values)
            with capture_routes(model) as rec:
                model(input_ids=torch.tensor([ids[:-1]]))
        out.append(judged_experience(prompt, ids[len(prompt):], logprobs,
                                     rec.sequences()[0].numpy(), temperature=temperature,
                                     max_tokens=max_tokens))
    return out


def judged_experience(prompt: list[int], completion: list[int], logprobs: list[float],
                      routes: Any, *, temperature: float, max_tokens: int,
                      finish_reason: str = "length", model_version: int = 0,
                      model_sha256: str = "0" * 64) -> ExperienceReady:
    """What the join makes of a generation (its tokens, behavior logprobs and routes, None
    where none were captured) with a reward from a hidden preference to learn: +1 when the
    first completion token is even, else -1."""
    event_id = f"evt-{uuid.uuid4().hex}"
    reward = 1.0 if completion[0] % 2 == 0 else -1.0
    return ExperienceReady(
        experience_id=experience_id_for(event_id), generation_id=f"gen-{uuid.uuid4().hex}",
        feedback_event_ids=[event_id], feedback_kind="accept" if reward > 0 else "reject",
        reward=reward, model_version=model_version, model_sha256=model_sha256,
        prompt_token_ids=PackedArray.pack(prompt, "int32"),
        completion_token_ids=PackedArray.pack(completion, "int32"),
        logprobs=PackedArray.pack(logprobs, "float32"),
        routed_experts=None if routes is None else PackedArray.pack(routes, "int16"),
        sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens),
        finish_reason=finish_reason, generated_at=utcnow())


def make_checkpoint(model_dir: Path, out: Path, *, scale: float, seed: int,
                    base: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A 'trainer checkpoint': the weights plus small seeded noise, as safetensors (the LM head
    the embeddings again where the model ties them)."""
    from transformers import AutoConfig

    weights = base if base is not None else load_model(model_dir).state_dict()
    gen = torch.Generator().manual_seed(seed)
    new = {n: (t + scale * torch.randn(t.shape, generator=gen)).to(t.dtype)
           for n, t in weights.items()}
    if AutoConfig.from_pretrained(model_dir).tie_word_embeddings:
        new["lm_head.weight"] = new["model.embed_tokens.weight"]
    save_weights(new, out)
    return new
