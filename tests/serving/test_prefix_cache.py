"""Prefix caching: a prompt that extends a recent sequence prefills only its new tokens, and
its tokens, logprobs (float tolerance) and routes are those of an engine without the cache."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from serving.engine import GenerationRequest, GenerationResult
from serving.prefix_cache import BLOCK, PrefixCache
from serving.torch_engine import TorchEngine


def kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One layer whose keys hold each token's id, so a hit shows which tokens it reused."""
    keys = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
    return [(keys, -keys)]


def test_lookup_finds_the_longest_cached_prefix_and_leaves_the_last_token_to_feed() -> None:
    cache = PrefixCache(1000)
    first = list(range(100, 140))  # 40 tokens
    cache.insert(first, kv(first), None)
    longer = first + list(range(500, 530))
    cache.insert(longer, kv(longer), torch.arange(70).view(70, 1, 1))

    prompt = longer[:60] + [7, 8, 9]  # shares 60 tokens with `longer`, 40 with `first`
    hit = cache.lookup(prompt)
    assert hit is not None and hit.length == 60
    assert hit.kv[0][0].flatten().tolist() == longer[:60]
    assert hit.routes is not None and hit.routes.flatten().tolist() == list(range(60))

    same = cache.lookup(first)  # an identical prompt: all but its last token
    assert same is not None and same.length == len(first) - 1
    assert cache.lookup(list(range(100, 100 + BLOCK - 1)) + [1, 2]) is None  # below min_reuse
    assert cache.lookup([1] * 50) is None
    assert (cache.lookups, cache.hits, cache.reused_tokens) == (4, 2, 60 + 39)


def test_a_prefix_that_diverges_inside_a_block_is_cut_there() -> None:
    cache = PrefixCache(1000)
    seq = list(range(64))
    cache.insert(seq, kv(seq), None)
    hit = cache.lookup(seq[:37] + [999] * 20)
    assert hit is not None and hit.length == 37  # two whole blocks, then 5 tokens compared


def test_entries_are_evicted_least_recently_used_within_the_token_budget() -> None:
    cache = PrefixCache(100)
    a, b, c = ([n] * 40 for n in (1, 2, 3))
    cache.insert(a, kv(a), None)
    cache.insert(b, kv(b), None)
    assert cache.lookup(a + [0]) is not None  # a is now the most recently used
    cache.insert(c, kv(c), None)  # 120 tokens > 100: b goes
    assert cache.lookup(b + [0]) is None
    assert cache.lookup(a + [0]) is not None and cache.lookup(c + [0]) is not None
    assert cache.tokens == 80 and len(cache) == 2
    cache.clear()
    assert cache.lookup(a + [0]) is None and cache.tokens == 0


def requests(prompts: list[list[int]]) -> list[GenerationRequest]:
    return [GenerationRequest(prompt_token_ids=p, max_tokens=12, temperature=1.0, seed=i)
            for i, p in enumerate(prompts)]


def generate(engine: TorchEngine, prompts: list[list[int]]) -> list[GenerationResult]:
    async def run() -> list[GenerationResult]:
        return list(await asyncio.gather(*(engine.generate(r) for r in requests(prompts))))

    return asyncio.run(run())


def assert_same(a: list[GenerationResult], b: list[GenerationResult]) -> None:
    for x, y in zip(a, b, strict=True):
        assert y.token_ids == x.token_ids
        assert y.logprobs == pytest.approx(x.logprobs, abs=1e-4)
        assert x.routed_experts is not None and y.routed_experts is not None
        assert (y.routed_experts == x.routed_experts).all()


def test_cached_prefills_match_an_engine_without_the_cache(model_dir: Path) -> None:
    plain = TorchEngine.load(model_dir, max_batch=8)
    cached = TorchEngine.load(model_dir, max_batch=8, prefix_cache_tokens=4096)
    try:
        group = [list(range(5, 60))] * 4  # one prompt sampled 4 times, as a GRPO group
        first = generate(plain, group)
        assert_same(first, generate(cached, group))
        # the next turn of each conversation: its whole history, then new tokens
        turn_two = [p + r.token_ids + [100, 101, 102] for p, r in zip(group, first, strict=True)]
        assert_same(generate(plain, turn_two), generate(cached, turn_two))
        pc = cached.prefix_cache
        assert pc is not None and pc.hits == 7  # every prefill but the very first
        # the group's copies: all but the prompt's last token; the next turns: the prompt and
        # every generated token but the last, which was sampled and never fed
        assert pc.reused_tokens == 3 * 54 + sum(55 + len(r.token_ids) - 1 for r in first)
        fed = sum(len(p) for p in group + turn_two)
        assert plain.prefilled_tokens == fed
        assert cached.prefilled_tokens == fed - pc.reused_tokens
    finally:
        plain.close()
        cached.close()


def test_a_wave_of_hits_and_misses_is_prefilled_in_one_forward(model_dir: Path) -> None:
    plain = TorchEngine.load(model_dir, max_batch=8)
    cached = TorchEngine.load(model_dir, max_batch=8, prefix_cache_tokens=4096)
    try:
        history = [list(range(5, 40)), list(range(9, 70))]
        generate(cached, history)
        # two continuations of different cached lengths, and a prompt never seen
        wave = [history[0] + [3, 4], history[1] + list(range(300, 320)), list(range(80, 100))]
        assert_same(generate(plain, wave), generate(cached, wave))
        pc = cached.prefix_cache
        assert pc is not None and pc.hits == 2
    finally:
        plain.close()
        cached.close()


def test_a_weight_change_empties_the_cache(model_dir: Path) -> None:
    cached = TorchEngine.load(model_dir, max_batch=8, prefix_cache_tokens=4096)
    plain = TorchEngine.load(model_dir, max_batch=8)
    try:
        prompts = [list(range(5, 60))]
        generate(cached, prompts)
        state = {k: v + 0.01 for k, v in cached.model.state_dict().items()}
        for engine in (cached, plain):
            engine.call_between_steps(lambda model: model.load_state_dict(state)).result()
        pc = cached.prefix_cache
        assert pc is not None and len(pc) == 0
        assert_same(generate(plain, prompts), generate(cached, prompts))
        assert pc.hits == 0
    finally:
        plain.close()
        cached.close()


def test_prefix_caching_and_bitwise_batch_invariance_exclude_each_other(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="batch-invariant"):
        TorchEngine.load(model_dir, prefix_cache_tokens=1024, batch_invariant=True)
