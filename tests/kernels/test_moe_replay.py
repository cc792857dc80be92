"""MoE route capture and replay on transformers' own MoE models (Qwen3-MoE, OLMoE, Mixtral).

Tests taking ``device`` run again on CUDA, marked ``gpu``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM

from kernels.batch_invariant import enable_batch_invariant
from kernels.moe_replay import (
    NO_ROUTE,
    RouteShapeError,
    capture_routes,
    find_routers,
    replay_routes,
    stack_routes,
)
from tests.kernels.helpers import DEVICES, decode_logprobs, random_sequences, tiny_model


def olmoe() -> torch.nn.Module:
    torch.manual_seed(0)
    return OlmoeForCausalLM(OlmoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
    )).eval()


def mixtral() -> torch.nn.Module:
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )).eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("invariant", [False, True], ids=["stock", "invariant"])
@pytest.mark.parametrize(
    "build", [tiny_model, olmoe, mixtral], ids=["qwen3_moe", "olmoe", "mixtral"]
)
def test_replaying_captured_routes_reproduces_logits(
    build: Callable[[], torch.nn.Module], invariant: bool, device: str
) -> None:
    model = build().to(device)
    if invariant:
        enable_batch_invariant(model)
    ids = torch.randint(0, 256, (3, 10)).to(device)
    with torch.no_grad(), capture_routes(model) as recorder:
        captured = model(input_ids=ids).logits
    routes = recorder.steps[0].routes  # (B, T, L, K) int16
    assert routes.dtype == torch.int16
    assert routes.shape == (3, 10, len(find_routers(model)), 2)
    with torch.no_grad(), replay_routes(model, routes):
        replayed = model(input_ids=ids).logits
    assert torch.equal(replayed, captured)


@pytest.mark.parametrize("device", DEVICES)
def test_forced_routes_change_output_and_router_gets_gradient(device: str) -> None:
    model = tiny_model().to(device)
    ids = torch.randint(0, 512, (2, 8)).to(device)
    with torch.no_grad(), capture_routes(model) as recorder:
        captured = model(input_ids=ids).logits
    forced = (recorder.steps[0].routes.long() + 3) % 8  # other experts everywhere
    with replay_routes(model, forced):
        logits = model(input_ids=ids).logits
    assert not torch.allclose(logits, captured)
    logits.logsumexp(-1).mean().backward()
    router = find_routers(model)[0]
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    with torch.no_grad(), capture_routes(model) as check, replay_routes(model, forced):
        model(input_ids=ids)
    assert torch.equal(check.steps[0].routes.long(), forced)  # the experts actually used


def test_no_route_entries_keep_the_routers_choice() -> None:
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 6))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
        with replay_routes(model, torch.full((2, 6, 4, 2), NO_ROUTE)):
            assert torch.equal(model(input_ids=ids).logits, stock)


def test_replay_rejects_misaligned_routes() -> None:
    model = tiny_model()
    with torch.no_grad(), replay_routes(model, torch.zeros(2, 5, 4, 2, dtype=torch.int16)):
        with pytest.raises(RouteShapeError):
            model(input_ids=torch.randint(0, 512, (2, 6)))


@pytest.mark.parametrize("device", DEVICES)
def test_decode_capture_equals_full_sequence_capture(device: str) -> None:
    """Left-padded prefill + incremental decode records, per real token, the same experts as
    one right-padded full-sequence forward (batch-invariant mode)."""
    model = enable_batch_invariant(tiny_model().to(device))
    seqs, prompt_lens = random_sequences(6, seed=5)
    _, decoded = decode_logprobs(model, seqs, prompt_lens)
    length = max(len(s) for s in seqs)
    ids = torch.zeros(6, length, dtype=torch.long)
    mask = torch.zeros(6, length, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)], mask[b, : len(s)] = torch.tensor(s), 1
    with torch.no_grad(), capture_routes(model) as recorder:
        model(input_ids=ids.to(device), attention_mask=mask.to(device))
    full = recorder.sequences()
    for b, s in enumerate(seqs):
        assert decoded[b].shape == (len(s) - 1, 4, 2)  # the last token is never fed in decode
        assert torch.equal(decoded[b], full[b][: len(s) - 1])


def test_stack_routes_places_sequences_at_offsets() -> None:
    a, b = torch.ones(3, 4, 2, dtype=torch.int16), torch.full((2, 4, 2), 5, dtype=torch.int16)
    out = stack_routes([a, b], length=4, offsets=[1, 0])
    assert out.shape == (2, 4, 4, 2) and out.dtype == torch.int16
    assert (out[0, 0] == NO_ROUTE).all() and (out[0, 1:] == 1).all()
    assert (out[1, :2] == 5).all() and (out[1, 2:] == NO_ROUTE).all()


@pytest.mark.parametrize("device", DEVICES)
def test_the_trainers_shared_prefix_under_replay_is_bit_exact(device: str) -> None:
    """The trainer's forward (trainer/policy.py) with a prefix shared by every row and replayed
    routes: the prefix once, then the rows over its key/value cache, gives the logprobs of one
    forward over whole rows bit for bit in the batch-invariant mode (on CUDA: the Triton
    kernels); the gradient reaches the router through both calls."""
    from trainer.policy import MIN_SHARED_PREFIX, TokenBatch, sequence_logprobs, shared_prefix

    model = enable_batch_invariant(tiny_model().to(device))
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(5, 512, (MIN_SHARED_PREFIX + 8,), generator=g).tolist()
    rows = [prefix + torch.randint(5, 512, (n,), generator=g).tolist() for n in (7, 19, 30)]
    start = len(prefix) + 2
    batch = TokenBatch.from_sequences(
        rows, [[0] * start + [1] * (len(r) - start) for r in rows], pad_id=0)
    routes = torch.randint(0, 8, (3, batch.tokens.shape[1], 4, 2), generator=g,
                           dtype=torch.int16)
    routes[:, :len(prefix)] = routes[:1, :len(prefix)]
    routes[:, :, :, 1] = (routes[:, :, :, 0] + 1) % 8  # two distinct experts per token
    routes[batch.attention_mask == 0] = NO_ROUTE
    assert shared_prefix(batch, limit=start - 1, routes=routes) == len(prefix)
    batch, routes = batch.to(torch.device(device)), routes.to(device)

    shared = sequence_logprobs(model, batch, share_prefix=True, routes=routes)
    (shared * batch.loss_mask).sum().backward()
    whole = sequence_logprobs(model, batch, share_prefix=False, routes=routes)
    assert torch.equal(shared.detach(), whole.detach())
    router = find_routers(model)[0]
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
