"""Triton batch-invariant kernels (kernels/triton_ops.py): parity with the stock ops, bitwise
invariance of a row's result across batch sizes, and gradients.

On CPU the kernels run in Triton's interpreter, which ``TRITON_INTERPRET=1`` selects when kernels
are defined, so that check runs ``check_kernels("cpu")`` in a child process; with CUDA the same
checks run compiled, plus a whole model under the switch (marked ``gpu``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.batch_invariant import BatchInvariantUnsupported, enable_batch_invariant
from kernels.bi_ops import bi_linear, bi_log_softmax, bi_rms_norm, token_logprobs

HAVE_TRITON = importlib.util.find_spec("triton") is not None
ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (the dev "
                                  "extra installs it on Linux x86_64)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def check_kernels(device: str) -> None:
    """Every kernel on ``device``: close to torch, rows bitwise independent of the batch."""
    from kernels import triton_ops as T

    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device)

    x, w = randn(70, 80), randn(50, 80)  # K, M and N not multiples of the tiles
    full = T.linear(x, w)
    torch.testing.assert_close(full, F.linear(x, w))
    for m in (1, 3, 17, 64, 65):
        assert torch.equal(T.linear(x[:m], w), full[:m]), m
    a, b = randn(3, 20, 40), randn(3, 30, 40).transpose(1, 2)  # strided operand
    torch.testing.assert_close(T.bmm(a, b), torch.bmm(a, b))
    assert torch.equal(T.bmm(a[:, :8], b), T.bmm(a, b)[:, :8])  # fewer rows: same bits
    if device == "cuda":  # a row moved within a tile: the interpreter's tl.dot is the host's
        # numpy matmul, whose bits depend on the row's place in the tile on some CPUs (AMD)
        assert torch.equal(T.bmm(a[:, 7:8], b), T.bmm(a, b)[:, 7:8])

    logits, hidden = randn(9, 2500) * 3, randn(9, 300)  # logits span several ROW_BLOCKs
    torch.testing.assert_close(T.log_softmax(logits), torch.log_softmax(logits, -1))
    torch.testing.assert_close(T.softmax(logits), torch.softmax(logits, -1))
    torch.testing.assert_close(T.row_sum(logits), logits.sum(-1, keepdim=True),
                               rtol=1e-5, atol=1e-3)
    normed = hidden / torch.sqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(T.rms_norm(hidden, 1e-6), normed)
    for op in (T.log_softmax, T.softmax, T.row_sum, lambda t: T.rms_norm(t, 1e-6)):
        for rows in (logits, hidden):
            assert torch.equal(op(rows[4:5]), op(rows)[4:5])

    xg, wg = x[:5].clone().requires_grad_(), w.clone().requires_grad_()
    T.log_softmax(T.rms_norm(T.linear(xg, wg), 1e-6))[:, 3].sum().backward()
    xr, wr = x[:5].clone().requires_grad_(), w.clone().requires_grad_()
    y = F.linear(xr, wr)
    torch.log_softmax(y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6), -1)[:, 3].sum() \
        .backward()
    assert xg.grad is not None and wg.grad is not None
    torch.testing.assert_close(xg.grad, xr.grad)
    torch.testing.assert_close(wg.grad, wr.grad)


@needs_triton
def test_triton_kernels_in_the_interpreter_on_cpu() -> None:
    code = "from tests.kernels.test_triton_ops import check_kernels; check_kernels('cpu')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_cpu_tensors_keep_the_aten_ops() -> None:
    loaded = "kernels.triton_ops" in sys.modules  # only a CUDA call in this process imports it
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    out = bi_log_softmax(bi_rms_norm(bi_linear(x, w), torch.ones(8), 1e-6))
    torch.testing.assert_close(out, torch.log_softmax(out, -1))
    assert ("kernels.triton_ops" in sys.modules) == loaded


def test_switch_refuses_devices_without_kernels() -> None:
    from tests.kernels.helpers import tiny_model

    with pytest.raises(BatchInvariantUnsupported, match="meta"):
        enable_batch_invariant(tiny_model().to("meta"))


@pytest.mark.gpu
@needs_triton
@needs_cuda
def test_triton_kernels_on_gpu() -> None:
    check_kernels("cuda")


@pytest.mark.gpu
@needs_triton
@needs_cuda
def test_model_logprobs_are_batch_invariant_on_gpu() -> None:
    """The switch on a CUDA model: a sequence's logprobs alone equal those inside a padded
    batch of another size (full-sequence forwards)."""
    from tests.kernels.helpers import random_sequences, tiny_model

    model = enable_batch_invariant(tiny_model().cuda())
    seqs, _ = random_sequences(9, seed=5)

    def logprobs(batch: list[list[int]]) -> list[torch.Tensor]:
        length = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), length, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(batch):
            ids[b, : len(s)], mask[b, : len(s)] = torch.tensor(s), 1
        ids, mask = ids.cuda(), mask.cuda()
        with torch.no_grad():
            lp = token_logprobs(model(input_ids=ids, attention_mask=mask).logits[:, :-1],
                                ids[:, 1:])
        return [lp[b, : len(s) - 1].cpu() for b, s in enumerate(batch)]

    together = logprobs(seqs)
    for i in (0, 4, 8):
        assert torch.equal(logprobs([seqs[i]])[0], together[i]), i
    assert torch.equal(torch.cat(logprobs(seqs[2:5])), torch.cat(together[2:5]))
