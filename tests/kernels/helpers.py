"""The tiny model, inputs and fixtures of the batch-invariance and MoE replay tests."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch
from transformers import DynamicCache, Qwen3MoeConfig, Qwen3MoeForCausalLM

from kernels.bi_ops import (
    token_logprobs,
)
from kernels.moe_replay import capture_routes

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs CUDA and triton")

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: the CI box has 2 shared cores and OpenMP spins badly under load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config(vocab: int = 512) -> Qwen3MoeConfig:
    """The default tiny Qwen3-MoE shape (vocab shrunk for speed)."""
    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
        max_position_embeddings=256,
    )


def tiny_model(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(tiny_config()).eval()


def random_sequences(n: int, seed: int, vocab: int = 512) -> tuple[list[list[int]], list[int]]:
    """n sequences with prompts of 2..12 tokens and 5 completion tokens; and prompt lengths."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, 13, (n,), generator=g).tolist()
    seqs = [torch.randint(0, vocab, (p + 5,), generator=g).tolist() for p in prompt_lens]
    return seqs, prompt_lens


def decode_logprobs(
    model: torch.nn.Module, seqs: list[list[int]], prompt_lens: list[int]
) -> tuple[list[list[float]], list[torch.Tensor]]:
    """Serving-style: left-padded prefill of the prompts, then one token per step through a
    DynamicCache (teacher-forced). Returns completion logprobs per row and captured routes."""
    batch, longest, device = len(seqs), max(prompt_lens), model.device
    ids = torch.zeros(batch, longest, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.long)
    for b, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        ids[b, longest - p :], mask[b, longest - p :] = torch.tensor(s[:p]), 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    steps = len(seqs[0]) - prompt_lens[0]
    logprobs: list[list[float]] = [[] for _ in seqs]
    with torch.no_grad(), capture_routes(model) as recorder:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                    past_key_values=cache, use_cache=True)
        for step in range(steps):
            tok = torch.tensor([s[p + step] for s, p in zip(seqs, prompt_lens, strict=True)],
                               device=device)
            lp = token_logprobs(out.logits[:, -1], tok)
            for b in range(batch):
                logprobs[b].append(lp[b].item())
            if step + 1 == steps:
                break
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos,
                        past_key_values=cache, use_cache=True)
    return logprobs, recorder.sequences()
