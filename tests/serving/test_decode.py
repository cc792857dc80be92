"""The lean decode step (serving/decode.py) against the model's own forward: same logits to
float tolerance and the same experts, on rows of different lengths, for one row (experts per
token) and many (grouped GEMMs), over several steps writing into the batch's store; a mixed step
(the batch's rows decode while new prompts, some past a cached prefix, are prefilled) against
the model's decode step and its prefill of each prompt; compiled, the same again, and weights
changed in place (a hot swap) are what it computes with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.moe_replay import capture_routes
from serving.batching import PaddedKVBatch, cache_kv
from serving.decode import Joining, Qwen3MoeDecoder, decode, lean_decoder
from serving.onednn import OneDnnWeights


@pytest.fixture(scope="module")
def model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def batch_of(model, prompts: list[list[int]]) -> PaddedKVBatch:
    batch = PaddedKVBatch()
    for prompt in prompts:
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        batch.add(cache_kv(out.past_key_values), len(prompt))
    return batch


@pytest.fixture(params=["off", "on"], ids=["blas", "onednn"])
def onednn(request) -> str:
    """The lean step's `onednn` mode: "on" gives the default model oneDNN copies, which
    "auto" leaves to models of 20M parameters or more where they measure faster."""
    if request.param == "on" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    return request.param


def test_a_small_model_gets_no_onednn_copies_unless_asked(model) -> None:
    assert OneDnnWeights.for_model(model) is None  # "auto": too small to gain
    assert OneDnnWeights.for_model(model, "off") is None
    if torch.backends.mkldnn.is_available():
        assert OneDnnWeights.for_model(model, "on") is not None


@pytest.mark.parametrize("rows", [1, 6])
def test_lean_step_matches_the_model_forward(model, rows: int, onednn: str) -> None:
    decoder = lean_decoder(model, onednn=onednn)
    assert isinstance(decoder, Qwen3MoeDecoder)
    assert (decoder.onednn is not None) == (onednn == "on")
    prompts = [[5 + r, 40, 41, 300 + r, 7][: 2 + r % 4] * (1 + r % 2) for r in range(rows)]
    with torch.inference_mode(), capture_routes(model) as recorder:
        ours, theirs = batch_of(model, prompts), batch_of(model, prompts)
        recorder.steps.clear()
        tokens = [11 + r for r in range(rows)]
        for _ in range(4):
            lean, lean_routes = decode(model, decoder, ours, tokens, recorder)
            ref, ref_routes = decode(model, None, theirs, tokens, recorder)
            assert not recorder.steps  # the model forward's step was popped, the lean one adds none
            torch.testing.assert_close(lean, ref, atol=1e-4, rtol=1e-4)
            assert lean_routes is not None and ref_routes is not None
            assert lean_routes.dtype == torch.int16 and torch.equal(lean_routes, ref_routes)
            for (k1, v1), (k2, v2) in zip(ours.step_kv(), theirs.step_kv(), strict=True):
                torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)  # the step's column too
                torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)
            ours.advance()
            theirs.advance()
            tokens = ref.argmax(dim=-1).tolist()


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_mixed_step_matches_the_model_decode_and_prefill(model, rows: int, onednn: str) -> None:
    decoder = lean_decoder(model, onednn=onednn)
    assert decoder is not None and (decoder.onednn is not None) == (onednn == "on")
    prompts = [[5 + r, 40, 41, 300 + r, 7][: 2 + r % 4] for r in range(rows)]
    new = [[9, 8, 7, 6, 5, 4, 3], [21, 22], [9, 8, 7, 6, 5, 4, 3, 31, 32]]  # the last: cached
    cached = 7  # the last prompt's first 7 tokens were computed before (the first prompt)
    with torch.inference_mode(), capture_routes(model) as recorder:
        ours, theirs = batch_of(model, prompts), batch_of(model, prompts)
        prefix = cache_kv(model(input_ids=torch.tensor([new[2][:cached]]),
                                use_cache=True).past_key_values)
        recorder.steps.clear()
        tokens = [11 + r for r in range(rows)]
        step = decoder.mixed(tokens, ours, [Joining(new[0]), Joining(new[1]),
                                            Joining(new[2][cached:], prefix)])
        assert step.logits.shape[0] == rows + 3
        if rows:
            ref, ref_routes = decode(model, None, theirs, tokens, recorder)
            torch.testing.assert_close(step.logits[:rows], ref, atol=1e-4, rtol=1e-4)
            assert step.routes is not None and torch.equal(step.routes, ref_routes)
            for (k1, v1), (k2, v2) in zip(ours.step_kv(), theirs.step_kv(), strict=True):
                torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)
        for i, prompt in enumerate(new):
            out = model(input_ids=torch.tensor([prompt]), use_cache=True)
            routes = recorder.pop_step().routes[0]  # (P, L, K)
            torch.testing.assert_close(step.logits[rows + i], out.logits[0, -1],
                                       atol=1e-4, rtol=1e-4)
            fed = step.joined_routes[i]
            assert fed is not None and torch.equal(fed, routes[len(routes) - len(fed):])
            for (k1, v1), (k2, v2) in zip(step.joined_kv[i], cache_kv(out.past_key_values),
                                          strict=True):
                torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)
        assert len(step.joined_routes[2]) == len(new[2]) - cached


def test_lean_step_is_off_where_it_does_not_apply(model) -> None:
    assert lean_decoder(model, batch_invariant=True) is None  # the invariant kernels need HF's

    class Other:
        config = type("Config", (), {"model_type": "llama"})()

    assert lean_decoder(Other()) is None


def test_compiled_step_matches_eager_and_sees_weights_swapped_in_place(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eager, compiled = lean_decoder(model), lean_decoder(model)
    assert eager is not None and compiled is not None and compiled.compile()

    def both(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        prompts = [[5 + r, 40, 41, 300 + r][: 2 + r % 3] for r in range(rows)]
        with torch.inference_mode():
            a, b = batch_of(model, prompts), batch_of(model, prompts)
            tokens = [11 + r for r in range(rows)]
            (la, ra), (lb, rb) = eager.step(tokens, a), compiled.step(tokens, b)
        assert ra is not None and rb is not None and torch.equal(ra, rb)
        return la, lb

    for rows in (1, 3, 7):  # one row, a few (compiled), many (eager either way)
        torch.testing.assert_close(*both(rows), atol=1e-4, rtol=1e-4)
    before, _ = both(1)
    with torch.no_grad():  # what a release's swap does: new values, written in place
        for p in model.parameters():
            p.mul_(1.5)
    after, after_compiled = both(1)
    assert not torch.allclose(before, after, atol=1e-3)
    torch.testing.assert_close(after_compiled, after, atol=1e-4, rtol=1e-4)
