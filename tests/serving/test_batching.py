"""Continuous batching: a request's tokens and logprobs do not depend on its batch-mates.

Requests join a running batch and leave it at different steps; each must sample the same tokens
with the same logprobs (float tolerance; bitwise with the batch-invariant kernels) as alone,
and carry one route row per token fed to the model.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from serving.batching import PaddedKVBatch
from serving.engine import GenerationRequest, GenerationResult, collect
from serving.tool_parsers import structural_tag
from serving.torch_engine import TorchEngine

# a forced call of a function with one text parameter: a grammar-masked request
FORCED_CALL = structural_tag("qwen_3_coder", json.dumps([{"type": "function", "function": {
    "name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                                   "required": ["text"]}}}]), "note", False)


def request(i: int, *, grammar: bool = False) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=[7 + i, 40, 41, 300 + i][: 2 + i % 3] * (1 + i % 2),
                             max_tokens=6 + 3 * i, temperature=0.8 if i % 3 else 0.0,
                             top_p=0.9 if i % 2 else 1.0, seed=1000 + i,
                             structural_tag=FORCED_CALL if grammar else None)


async def staggered(engine: TorchEngine, n: int,
                    grammar: Callable[[int], bool] = lambda i: False) -> list[GenerationResult]:
    async def later(i: int) -> GenerationResult:
        await asyncio.sleep(0.01 * i)  # joins a batch that is already decoding
        return await engine.generate(request(i, grammar=grammar(i)))

    return list(await asyncio.gather(*(later(i) for i in range(n))))


def wait_idle(engine: TorchEngine) -> bool:
    """The last result is sent just before its row leaves the batch."""
    for _ in range(200):
        if engine.active == 0:
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    e = TorchEngine.load(model_dir, max_batch=4)
    yield e
    e.close()


def test_a_small_model_is_served_on_one_torch_thread(engine: TorchEngine) -> None:
    """serving.config.default_threads, as the engine thread sees it (the load ran on a thread
    that ended, so the setting must reach the engine's own)."""
    assert engine.threads == 1


def test_batched_requests_match_running_alone(engine: TorchEngine) -> None:
    alone = [asyncio.run(engine.generate(request(i))) for i in range(6)]
    together = asyncio.run(staggered(engine, 6))  # 6 requests, 4 rows: some wait, then join
    for a, b in zip(alone, together, strict=True):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert b.finish_reason == a.finish_reason
        assert b.routed_experts is not None
        assert (b.routed_experts == a.routed_experts).all()
    cfg = engine.model.config
    for i, r in enumerate(together):
        rows = len(request(i).prompt_token_ids) + len(r.token_ids) - 1
        assert r.routed_experts.shape == (rows, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert wait_idle(engine)


def test_requests_that_arrive_together_are_prefilled_together_and_match_alone(
        engine: TorchEngine) -> None:
    alone = [asyncio.run(engine.generate(request(i))) for i in range(4)]
    fed = engine.prefilled_tokens

    async def together() -> list[GenerationResult]:  # all in the inbox before the next step
        return list(await asyncio.gather(*(engine.generate(request(i)) for i in range(4))))

    for a, b in zip(alone, asyncio.run(together()), strict=True):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert b.routed_experts is not None and a.routed_experts is not None
        assert b.routed_experts.shape == a.routed_experts.shape  # no route rows for pads
        assert (b.routed_experts == a.routed_experts).all()
    assert engine.prefilled_tokens - fed == sum(len(request(i).prompt_token_ids)
                                                for i in range(4))
    assert wait_idle(engine)


def test_weights_written_between_steps_are_what_the_next_steps_use(model_dir: Path) -> None:
    """Six rows at once: the lean step's GEMMs run on its oneDNN copies of the weights, which
    a write through the engine (a swap, a load) must replace."""
    from transformers import AutoModelForCausalLM

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")

    new = {k: v * 1.25 for k, v in AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).state_dict().items()}
    greedy = [GenerationRequest(prompt_token_ids=[7 + i, 40, 41, 300 + i], max_tokens=8,
                                temperature=0.0) for i in range(6)]

    async def together(engine: TorchEngine) -> list[GenerationResult]:
        return list(await asyncio.gather(*(engine.generate(r) for r in greedy)))

    engine = TorchEngine.load(model_dir, max_batch=8, onednn="on")  # copies, small as it is
    fresh = TorchEngine.load(model_dir)
    try:
        before = asyncio.run(together(engine))
        engine.call_between_steps(lambda model: model.load_state_dict(new)).result()
        fresh.call_between_steps(lambda model: model.load_state_dict(new)).result()
        after, expected = asyncio.run(together(engine)), [
            asyncio.run(fresh.generate(r)) for r in greedy]  # one by one: no oneDNN copies
    finally:
        engine.close()
        fresh.close()
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    for a, b in zip(after, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_batch_invariant_mode_is_bitwise(model_dir: Path) -> None:
    """Also for rows a grammar masks (a forced function call), beside rows it does not."""
    pytest.importorskip("kernels.batch_invariant")
    engine = TorchEngine.load(model_dir, max_batch=4, batch_invariant=True)
    try:
        alone = [asyncio.run(engine.generate(request(i, grammar=i % 2 == 1)))
                 for i in range(4)]
        together = asyncio.run(staggered(engine, 4, grammar=lambda i: i % 2 == 1))
    finally:
        engine.close()
    for a, b in zip(alone, together, strict=True):
        assert (b.token_ids, b.logprobs) == (a.token_ids, a.logprobs)
    call = "<tool_call>\n<function=note>\n"  # what the grammar forces the masked rows into
    assert all(call.startswith(r.text) or r.text.startswith(call) for r in alone[1::2])


def test_stream_matches_generate_and_closing_it_cancels(engine: TorchEngine) -> None:
    req = GenerationRequest(prompt_token_ids=[5, 6, 7], max_tokens=12, temperature=1.0, seed=3)

    async def run() -> tuple[str, GenerationResult, GenerationResult]:
        text = ""
        async for delta in engine.stream(req):
            text += delta.text
        whole = await engine.generate(req)
        stream = engine.stream(GenerationRequest(prompt_token_ids=[5, 6, 7], max_tokens=400))
        await anext(stream)
        await stream.aclose()  # the client went away
        await asyncio.to_thread(wait_idle, engine)
        return text, whole, await collect(engine.stream(req))

    text, whole, again = asyncio.run(run())
    assert text == whole.text
    assert again.token_ids == whole.token_ids
    assert wait_idle(engine)


def test_padded_batch_joins_leaves_and_trims() -> None:
    def row(length: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.full((1, 2, length, 4), fill), torch.full((1, 2, length, 4), fill))]

    batch = PaddedKVBatch()
    batch.add(row(3, 1.0), 3)
    batch.add(row(5, 2.0), 5)
    assert batch.mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.positions.tolist() == [3, 5]
    keys = batch.kv()[0][0]  # (B, H, S, D)
    assert keys[0, :, :2].abs().sum() == 0 and (keys[0, :, 2:] == 1).all()
    mask, positions = batch.step_inputs()
    assert mask.shape == (2, 6) and positions.tolist() == [[3], [5]]
    step_keys, step_values = batch.step_kv()[0]  # a decode step writes its column in place
    step_keys[:, :, -1], step_values[:, :, -1] = 3.0, 3.0
    batch.advance()
    batch.keep([0])  # the long row leaves: the pad columns of row 0 are trimmed
    assert batch.mask.tolist() == [[1, 1, 1, 1]]
    assert batch.kv()[0][0][0, 0, :, 0].tolist() == [1.0, 1.0, 1.0, 3.0]
    assert batch.positions.tolist() == [4]


def test_decode_steps_write_in_place_and_the_store_grows_when_full() -> None:
    batch = PaddedKVBatch()
    batch.add([(torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1))], 2)
    for step in range(1, 151):  # past the first store's spare columns
        keys, values = batch.step_kv()[0]
        keys[:, :, -1], values[:, :, -1] = float(step), -float(step)
        batch.advance()
    keys, values = batch.kv()[0]
    assert keys[0, 0, :, 0].tolist() == [0.0, 0.0, *map(float, range(1, 151))]
    assert (values == -keys).all() and batch.positions.tolist() == [152]


def test_the_model_forward_path_commits_its_step_into_the_store() -> None:
    batch = PaddedKVBatch()
    batch.add([(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))], 3)
    cache = batch.dynamic_cache()
    cache.update(torch.full((1, 2, 1, 4), 7.0), torch.full((1, 2, 1, 4), 8.0), 0)  # the forward
    batch.commit(cache)
    batch.advance()
    keys, values = batch.kv()[0]
    assert keys[0, 0, :, 0].tolist() == [1.0, 1.0, 1.0, 7.0]
    assert values[0, 0, :, 0].tolist() == [1.0, 1.0, 1.0, 8.0]


def test_extend_lays_rows_out_as_adding_them_one_by_one() -> None:
    def row(length: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.full((1, 2, length, 4), fill), torch.full((1, 2, length, 4), -fill))]

    sizes = [(3, 1.0), (5, 2.0), (2, 3.0)]
    for start in ([], [(4, 9.0)]):  # into an empty batch, and into one with a row
        one_by_one, together = PaddedKVBatch(), PaddedKVBatch()
        for length, fill in start:
            one_by_one.add(row(length, fill), length)
            together.add(row(length, fill), length)
        for length, fill in sizes:
            one_by_one.add(row(length, fill), length)
        together.extend([(row(length, fill), length) for length, fill in sizes])
        assert together.mask.tolist() == one_by_one.mask.tolist()
        assert together.positions.tolist() == one_by_one.positions.tolist()
        (ka, va), (kb, vb) = together.kv()[0], one_by_one.kv()[0]
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        keys, values = together.row_kv(len(start))[0]  # the first new row: 3 real columns
        assert keys.shape == (1, 2, 3, 4) and (keys == 1.0).all() and (values == -1.0).all()


def test_rows_joining_and_leaving_in_place_match_a_batch_built_afresh() -> None:
    """Rows join (some longer than the batch, which widens it to the left), decode, and leave
    from anywhere in `compact_order`, for a few hundred steps: the live keys/values, mask and
    positions always equal a batch built from scratch out of each row's own tokens, pads zero."""
    import random

    from serving.batching import compact_order

    rng, batch, made = random.Random(0), PaddedKVBatch(), 0
    rows: list[list[float]] = []  # each live row's real columns (a value per column)

    def kv_of(values: list[float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x = torch.tensor(values).view(1, 1, -1, 1).expand(1, 2, -1, 3).contiguous()
        return [(x, -x), (2 * x, -2 * x)]  # two layers

    for _ in range(300):
        if rows and rng.random() < 0.3:  # some rows finish
            keep = sorted(rng.sample(range(len(rows)), rng.randint(0, len(rows))))
            order = compact_order(keep)
            assert sorted(order) == keep
            assert all(b == r for b, r in enumerate(order) if r < len(keep))  # those stay
            batch.keep(order)
            rows = [rows[b] for b in order]
        if rng.random() < 0.4:  # some join, any length
            new = [[float(made := made + 1)] * rng.randint(1, 40) for _ in range(rng.randint(1, 3))]
            batch.extend([(kv_of(r), len(r)) for r in new])
            rows += new
        if rows:  # a decode step
            for layer, (keys, values) in enumerate(batch.step_kv()):
                column = torch.tensor([1000.0 + len(r) for r in rows]).view(-1, 1, 1)
                keys[:, :, -1], values[:, :, -1] = (layer + 1) * column, -(layer + 1) * column
            batch.advance()
            rows = [r + [1000.0 + len(r)] for r in rows]
        fresh = PaddedKVBatch()
        fresh.extend([(kv_of(r), len(r)) for r in rows])
        assert batch.mask.tolist() == fresh.mask.tolist()
        assert batch.positions.tolist() == [len(r) for r in rows]
        for (ka, va), (kb, vb) in zip(batch.kv(), fresh.kv(), strict=True):
            assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_torch_work_on_its_own_thread_returns_or_raises_and_the_thread_ends() -> None:
    """serving.config.on_own_thread: what TorchEngine.load and a swap's preparation run on,
    so that no long-lived thread but the engine's keeps a pool of torch's OpenMP workers."""
    import threading

    from serving.config import on_own_thread

    ran: list[threading.Thread] = []

    def work() -> float:
        ran.append(threading.current_thread())
        return float(torch.ones(64, 1024).sum())

    def fail() -> None:
        raise ValueError("bad input")

    assert on_own_thread(work) == 64 * 1024
    assert ran[0] is not threading.current_thread() and not ran[0].is_alive()
    with pytest.raises(ValueError, match="bad input"):
        on_own_thread(fail)
