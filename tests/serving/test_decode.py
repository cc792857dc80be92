"""The lean decode step (serving/decode.py) against the model's own forward, for every family
Flywheel builds (the default Qwen3-MoE; dense Qwen3, Llama and Mistral; Mixtral and OLMoE):
same logits to float tolerance and the same experts, on rows of different lengths, for one row
(experts per token) and many (grouped GEMMs), over several steps writing into the batch's
store; a mixed step (the batch's rows decode while new prompts, some past a cached prefix, are
prefilled) against the model's decode step and its prefill of each prompt; compiled, the same
again, and weights changed in place (a hot swap) are what it computes with."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import get_args

import pytest
import torch

from kernels.moe_replay import capture_routes
from serving.batching import PaddedKVBatch, cache_kv
from serving.decode import Joining, LeanDecoder, decode, lean_decoder
from serving.onednn import OneDnnWeights
from trainer.config import MOE_FAMILIES, ModelFamily, TinyModelSettings
from trainer.init_model import init_model


def load(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(model_dir: Path):
    """The default model: the family the engine serves unless told otherwise."""
    return load(model_dir)


@pytest.fixture(scope="module", params=get_args(ModelFamily))
def family_model(request: pytest.FixtureRequest, model_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory):
    """The default model, and every other family at a tiny shape (2 layers, 64 wide)."""
    family = request.param
    if family == "qwen3_moe":
        return load(model_dir)
    shape = TinyModelSettings(family=family, hidden_size=64, num_layers=2, head_dim=16,
                              moe_intermediate_size=32)
    return load(init_model(shape, tmp_path_factory.mktemp(family) / "base"))


def recording(model):
    """The routes recorder of a MoE model's forwards; None (nothing to record) for a dense one."""
    if model.config.model_type not in MOE_FAMILIES:
        return nullcontext(None)
    return capture_routes(model)


def routes_equal(ours: torch.Tensor | None, theirs: torch.Tensor | None, model) -> bool:
    """The lean step's experts are the recorder's for a MoE, and None for a dense model."""
    if model.config.model_type not in MOE_FAMILIES:
        return ours is None and theirs is None
    return (ours is not None and theirs is not None and ours.dtype == torch.int16
            and torch.equal(ours, theirs))


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
def test_lean_step_matches_the_model_forward(family_model, rows: int, onednn: str) -> None:
    model = family_model
    decoder = lean_decoder(model, onednn=onednn)
    assert isinstance(decoder, LeanDecoder)
    assert (decoder.onednn is not None) == (onednn == "on")
    prompts = [[5 + r, 40, 41, 300 + r, 7][: 2 + r % 4] * (1 + r % 2) for r in range(rows)]
    with torch.inference_mode(), recording(model) as recorder:
        ours, theirs = batch_of(model, prompts), batch_of(model, prompts)
        if recorder is not None:
            recorder.steps.clear()
        tokens = [11 + r for r in range(rows)]
        for _ in range(4):
            lean, lean_routes = decode(model, decoder, ours, tokens, recorder)
            ref, ref_routes = decode(model, None, theirs, tokens, recorder)
            # the model forward's step was popped, the lean one adds none
            assert recorder is None or not recorder.steps
            torch.testing.assert_close(lean, ref, atol=1e-4, rtol=1e-4)
            assert routes_equal(lean_routes, ref_routes, model)
            for (k1, v1), (k2, v2) in zip(ours.step_kv(), theirs.step_kv(), strict=True):
                torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)  # the step's column too
                torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)
            ours.advance()
            theirs.advance()
            tokens = ref.argmax(dim=-1).tolist()


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_mixed_step_matches_the_model_decode_and_prefill(family_model, rows: int,
                                                         onednn: str) -> None:
    model = family_model
    decoder = lean_decoder(model, onednn=onednn)
    assert decoder is not None and (decoder.onednn is not None) == (onednn == "on")
    prompts = [[5 + r, 40, 41, 300 + r, 7][: 2 + r % 4] for r in range(rows)]
    new = [[9, 8, 7, 6, 5, 4, 3], [21, 22], [9, 8, 7, 6, 5, 4, 3, 31, 32]]  # the last: cached
    cached = 7  # the last prompt's first 7 tokens were computed before (the first prompt)
    with torch.inference_mode(), recording(model) as recorder:
        ours, theirs = batch_of(model, prompts), batch_of(model, prompts)
        prefix = cache_kv(model(input_ids=torch.tensor([new[2][:cached]]),
                                use_cache=True).past_key_values)
        if recorder is not None:
            recorder.steps.clear()
        tokens = [11 + r for r in range(rows)]
        step = decoder.mixed(tokens, ours, [Joining(new[0]), Joining(new[1]),
                                            Joining(new[2][cached:], prefix)])
        assert step.logits.shape[0] == rows + 3
        if rows:
            ref, ref_routes = decode(model, None, theirs, tokens, recorder)
            torch.testing.assert_close(step.logits[:rows], ref, atol=1e-4, rtol=1e-4)
            assert routes_equal(step.routes, ref_routes, model)
            for (k1, v1), (k2, v2) in zip(ours.step_kv(), theirs.step_kv(), strict=True):
                torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)
        for i, prompt in enumerate(new):
            out = model(input_ids=torch.tensor([prompt]), use_cache=True)
            routes = None if recorder is None else recorder.pop_step().routes  # (1, P, L, K)
            torch.testing.assert_close(step.logits[rows + i], out.logits[0, -1],
                                       atol=1e-4, rtol=1e-4)
            fed = step.joined_routes[i]
            if routes is None:
                assert fed is None
            else:
                assert fed is not None and torch.equal(fed, routes[0][len(routes[0]) - len(fed):])
            for (k1, v1), (k2, v2) in zip(step.joined_kv[i], cache_kv(out.past_key_values),
                                          strict=True):
                torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)
        joined = step.joined_routes[2]
        assert joined is None or len(joined) == len(new[2]) - cached


def test_lean_step_is_off_where_it_does_not_apply(model) -> None:
    assert lean_decoder(model, batch_invariant=True) is None  # the invariant kernels need HF's

    class Other:
        config = type("Config", (), {"model_type": "gpt2"})()

    assert lean_decoder(Other()) is None


@pytest.mark.parametrize("family", ["qwen3_moe", "llama"])
def test_compiled_step_matches_eager_and_sees_weights_swapped_in_place(
        family: str, model_dir: Path, tmp_path: Path) -> None:
    if family != "qwen3_moe":  # a dense family: no routes, every step's shapes data-independent
        model_dir = init_model(TinyModelSettings(family=family, hidden_size=64, num_layers=2,
                                                 head_dim=16), tmp_path / family)
    model = load(model_dir)  # its own: the test writes its weights
    eager, compiled = lean_decoder(model), lean_decoder(model)
    assert eager is not None and compiled is not None and compiled.compile()

    def both(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        prompts = [[5 + r, 40, 41, 300 + r][: 2 + r % 3] for r in range(rows)]
        with torch.inference_mode():
            a, b = batch_of(model, prompts), batch_of(model, prompts)
            tokens = [11 + r for r in range(rows)]
            (la, ra), (lb, rb) = eager.step(tokens, a), compiled.step(tokens, b)
        assert routes_equal(ra, rb, model)
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
