"""Batch-invariant kernels: parity with the stock ops, and bitwise invariance of a row's result
across batch sizes, padding, thread counts and prefill vs decode. Runs in seconds on CPU.

Tests taking ``device`` run again on CUDA (the Triton kernels), marked ``gpu``."""

from __future__ import annotations

import pytest
import torch

from kernels.batch_invariant import (
    batch_invariant,
    bi_experts_forward,
    disable_batch_invariant,
    enable_batch_invariant,
    is_batch_invariant,
)
from kernels.bi_attention import attention_reference, bi_attention
from kernels.bi_ops import (
    bi_linear,
    bi_log_softmax,
    bi_rms_norm,
    bi_silu,
    bi_softmax,
    linear_reference,
    log_softmax_reference,
    rms_norm_reference,
    silu_reference,
    softmax_reference,
    token_logprobs,
)
from kernels.moe_replay import replay_routes, stack_routes
from tests.kernels.helpers import (
    DEVICES,
    decode_logprobs,
    one_thread,  # noqa: F401  (a fixture)
    random_sequences,
    tiny_model,
)


def trainer_logprobs(
    model: torch.nn.Module, seqs: list[list[int]], prompt_lens: list[int],
    routes: list[torch.Tensor] | None = None,
) -> list[list[float]]:
    """Trainer-style: one right-padded full-sequence forward, optionally replaying routes."""
    length = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)], mask[b, : len(s)] = torch.tensor(s), 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    with torch.no_grad():
        if routes is None:
            logits = model(input_ids=ids, attention_mask=mask).logits
        else:
            with replay_routes(model, stack_routes(routes, length)):
                logits = model(input_ids=ids, attention_mask=mask).logits
    lp = token_logprobs(logits[:, :-1], ids[:, 1:])  # (B, T-1): logprob of token t+1
    return [lp[b, p - 1 : len(s) - 1].tolist() for b, (s, p) in enumerate(zip(seqs, prompt_lens,
                                                                              strict=True))]


# ---- op parity (close to the stock op) ------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_ops_match_their_references(device: str) -> None:
    torch.manual_seed(0)
    x, w, b = (t.to(device) for t in (torch.randn(37, 128), torch.randn(96, 128), torch.randn(96)))
    torch.testing.assert_close(bi_linear(x, w, b), linear_reference(x, w, b))
    torch.testing.assert_close(bi_silu(x * 4), silu_reference(x * 4))
    g = torch.randn(128, device=device)
    torch.testing.assert_close(bi_rms_norm(x, g, 1e-6), rms_norm_reference(x, g, 1e-6))
    logits = torch.randn(5, 7, 300).to(device) * 3
    torch.testing.assert_close(bi_softmax(logits, 1), softmax_reference(logits, 1))
    torch.testing.assert_close(bi_log_softmax(logits), log_softmax_reference(logits))


@pytest.mark.parametrize("device", DEVICES)
def test_attention_matches_reference_with_padding_and_gqa(device: str) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, h, 9, 32).to(device) for h in (4, 2, 2))
    causal = torch.ones(9, 9, device=device).tril().bool()
    mask = causal[None, None].repeat(3, 1, 1, 1)
    mask[1, ..., :3] = False  # row 1 left-padded by 3
    mask[2, ..., 6:] = False  # row 2 right-padded after 6
    real = mask.any(-1)[:, 0]  # (B, Tq) queries with at least one key
    got = bi_attention(q, k, v, mask, 32**-0.5)[real]
    torch.testing.assert_close(got, attention_reference(q, k, v, mask, 32**-0.5)[real])
    causal_only = bi_attention(q, k, v, None, 0.2)
    torch.testing.assert_close(causal_only, attention_reference(q, k, v, None, 0.2))


@pytest.mark.parametrize("device", DEVICES)
def test_experts_match_eager_loop(device: str) -> None:
    model = tiny_model().to(device)
    experts = model.model.layers[0].mlp.experts
    torch.manual_seed(1)
    hidden = torch.randn(23, 128).to(device)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(23)]).to(device)
    weights = torch.rand(23, 2).to(device)
    model.config._experts_implementation = "eager"
    torch.testing.assert_close(bi_experts_forward(experts, hidden, idx, weights),
                               experts(hidden, idx, weights))
    sentinel = idx.clone()
    sentinel[::3, 1] = 8  # expert parallelism marks experts held elsewhere with num_experts
    torch.testing.assert_close(bi_experts_forward(experts, hidden, sentinel, weights),
                               experts(hidden, idx, weights.masked_fill(sentinel == 8, 0.0)))
    nowhere = torch.full((2, 2), 8, device=device)
    assert not bi_experts_forward(experts, hidden[:2], nowhere, weights[:2]).any()


# ---- bitwise invariance ---------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_linear_row_is_bitwise_independent_of_batch_size_and_threads(device: str) -> None:
    torch.manual_seed(0)
    w, x = torch.randn(4096, 128).to(device), torch.randn(70, 128).to(device)
    alone = torch.cat([bi_linear(x[i : i + 1], w) for i in range(70)])
    for m in (2, 3, 5, 7, 9, 11, 16, 17, 33, 70):
        assert torch.equal(bi_linear(x[:m], w), alone[:m]), m
    torch.set_num_threads(2)
    assert torch.equal(bi_linear(x, w), alone)


@pytest.mark.parametrize("device", DEVICES)
def test_elementwise_and_row_ops_are_position_independent(device: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(1000).to(device) * 8
    single = torch.cat([bi_silu(x[i : i + 1]) for i in range(1000)])
    assert torch.equal(bi_silu(x), single)
    rows, g = torch.randn(40, 128).to(device), torch.randn(128).to(device)
    assert torch.equal(bi_rms_norm(rows[:1], g, 1e-6), bi_rms_norm(rows, g, 1e-6)[:1])
    logits = torch.randn(40, 512).to(device)
    assert torch.equal(bi_log_softmax(logits[3:4]), bi_log_softmax(logits)[3:4])


@pytest.mark.parametrize("device", DEVICES)
def test_experts_token_is_bitwise_independent_of_the_other_tokens(device: str) -> None:
    experts = tiny_model().to(device).model.layers[0].mlp.experts
    torch.manual_seed(2)
    hidden, weights = torch.randn(40, 128).to(device), torch.rand(40, 2).to(device)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(40)]).to(device)
    full = bi_experts_forward(experts, hidden, idx, weights)
    for i in (0, 7, 39):
        assert torch.equal(bi_experts_forward(experts, hidden[i : i + 1], idx[i : i + 1],
                                              weights[i : i + 1]), full[i : i + 1]), i
    assert torch.equal(bi_experts_forward(experts, hidden[5:14], idx[5:14], weights[5:14]),
                       full[5:14])


@pytest.mark.parametrize("device", DEVICES)
def test_attention_prefill_row_equals_decode_step_under_any_padding(device: str) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 70, 32).to(device) for h in (4, 2, 2))
    prefill = bi_attention(q, k, v, None, 0.17)  # (1, 70, H, D)
    for t in (0, 5, 63, 64, 69):
        for pad in (0, 3, 17):  # the same row, left-padded inside a decode batch
            kp = torch.cat([torch.randn(1, 2, pad, 32).to(device), k[:, :, : t + 1]], dim=2)
            vp = torch.cat([torch.randn(1, 2, pad, 32).to(device), v[:, :, : t + 1]], dim=2)
            mask = torch.ones(1, 1, 1, pad + t + 1, dtype=torch.bool, device=device)
            mask[..., :pad] = False
            step = bi_attention(q[:, :, t : t + 1], kp, vp, mask, 0.17)
            assert torch.equal(step[0, 0], prefill[0, t]), (t, pad)


@pytest.mark.parametrize("device", DEVICES)
def test_model_logprobs_and_routes_are_identical_across_batches_and_paths(device: str) -> None:
    """Acceptance: batch-invariant mode + router replay -> |dlogprob| = 0 and equal routes, for
    decode at batch sizes 1, 7 and 32 and a trainer forward of another composition."""
    model = enable_batch_invariant(tiny_model().to(device))
    seqs, prompt_lens = random_sequences(32, seed=3)
    lp32, routes32 = decode_logprobs(model, seqs, prompt_lens)
    lp7, routes7 = decode_logprobs(model, seqs[5:12], prompt_lens[5:12])
    lp1, routes1 = decode_logprobs(model, seqs[9:10], prompt_lens[9:10])
    assert lp7 == lp32[5:12] and lp1 == lp32[9:10]
    assert all(torch.equal(a, b) for a, b in zip(routes7, routes32[5:12], strict=True))
    assert torch.equal(routes1[0], routes32[9])
    order = list(range(31, -1, -3))  # a different batch for the trainer
    trained = trainer_logprobs(model, [seqs[i] for i in order], [prompt_lens[i] for i in order],
                               [routes32[i] for i in order])
    assert trained == [lp32[i] for i in order]


@pytest.mark.parametrize("device", DEVICES)
def test_switch_restores_stock_forward(device: str) -> None:
    model = tiny_model().to(device)
    ids = torch.randint(0, 512, (2, 9)).to(device)
    with torch.no_grad():
        stock = model(input_ids=ids).logits
        keys = set(model.state_dict())
        with batch_invariant(model):
            assert is_batch_invariant(model)
            on = model(input_ids=ids).logits
        assert not is_batch_invariant(model)
        assert torch.equal(model(input_ids=ids).logits, stock)
    torch.testing.assert_close(on, stock, rtol=1e-4, atol=1e-5)
    assert set(model.state_dict()) == keys
    experts = model.get_experts_implementation()
    enable_batch_invariant(model)
    assert model.config._attn_implementation == "flywheel_batch_invariant"
    disable_batch_invariant(model)
    # the private field enable_batch_invariant reads to restore (no public getter in 5.19)
    assert model.config._attn_implementation == "sdpa"
    assert model.get_experts_implementation() == experts


def test_gradients_through_the_kernels_match_the_stock_model() -> None:
    """The trainer backpropagates through the batch-invariant forward: the same gradients as
    the stock one (in-place ops on results autograd keeps would break or corrupt them)."""
    ids = torch.randint(0, 512, (3, 11), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # padding on the right, as the trainer batches
    grads = []
    for invariant in (False, True):
        model = tiny_model()
        if invariant:
            enable_batch_invariant(model)
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits.float().logsumexp(-1) * mask).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    stock, invariant_grads = grads
    assert stock.keys() == invariant_grads.keys()
    for name, grad in stock.items():
        torch.testing.assert_close(invariant_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
