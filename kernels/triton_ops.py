"""Batch-invariant Triton kernels: what ``kernels.bi_ops`` runs for CUDA tensors.

The same rule as on CPU, enforced by construction rather than by picking ATen kernels:
- ``bmm``/``linear``: every output tile is (BLOCK_M, BLOCK_N) and reduces K in BLOCK_K steps
  from 0 upwards in one program; tile sizes are constants (never chosen from M), there is no
  split-K, and M is not a specialisation key, so a row's bits do not depend on how many rows
  are computed with it. fp32 inputs use IEEE dot products (no TF32).
- ``log_softmax``/``softmax``/``row_sum``/``rms_norm``: one program per row, walking the row in
  fixed ROW_BLOCK steps; the per-lane partial sums are reduced once at the end by one fixed tree.
Each op's reference is the stock torch op (parity tests in tests/kernels/test_triton_ops.py).
This module imports triton; ``kernels.bi_ops`` imports it only when a CUDA tensor shows up.
``TRITON_INTERPRET=1`` (set before triton is imported) runs the kernels on CPU tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32  # fixed GEMM tiles, independent of M
ROW_BLOCK = 1024  # columns per step of the row kernels
LOG_SOFTMAX, SOFTMAX, ROW_SUM = 0, 1, 2  # row kernel modes


@triton.jit(do_not_specialize=["M"])
def _bmm_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
                PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr):
    batch = tl.program_id(2).to(tl.int64)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_rows = a_ptr + batch * s_ab + rm[:, None] * s_am
    b_cols = b_ptr + batch * s_bb + rn[None, :] * s_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):  # one K order for every tile: no split-K
        kk = k0 + rk
        a = tl.load(a_rows + kk[None, :] * s_ak, mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(b_cols + kk[:, None] * s_bk, mask=(kk[:, None] < K) & (rn[None, :] < N),
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    c = c_ptr + batch * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _row_kernel(x_ptr, out_ptr, N, s_x, s_out, MODE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, out_row = x_ptr + row * s_x, out_ptr + row * s_out
    cols = tl.arange(0, BLOCK)
    top = 0.0
    if MODE != 2:  # the max is exact in any order
        lanes_max = tl.full((BLOCK,), float("-inf"), tl.float32)
        for c0 in range(0, N, BLOCK):
            x = tl.load(x_row + c0 + cols, mask=c0 + cols < N, other=float("-inf"))
            lanes_max = tl.maximum(lanes_max, x.to(tl.float32))
        top = tl.max(lanes_max, axis=0)
    lanes = tl.zeros((BLOCK,), tl.float32)
    for c0 in range(0, N, BLOCK):  # blocks in order; each lane sums its own columns
        x = tl.load(x_row + c0 + cols, mask=c0 + cols < N, other=float("-inf")).to(tl.float32)
        if MODE == 2:
            lanes += tl.where(c0 + cols < N, x, 0.0)
        else:
            lanes += tl.exp(x - top)
    total = tl.sum(lanes, axis=0)  # one fixed tree over the lanes
    if MODE == 2:
        tl.store(out_row, total)
    else:
        for c0 in range(0, N, BLOCK):
            x = tl.load(x_row + c0 + cols, mask=c0 + cols < N, other=0.0).to(tl.float32)
            if MODE == 0:
                y = x - top - tl.log(total)
            else:
                y = tl.div_rn(tl.exp(x - top), total)
            tl.store(out_row + c0 + cols, y, mask=c0 + cols < N)


@triton.jit
def _rms_norm_kernel(x_ptr, out_ptr, N, s_x, s_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, out_row = x_ptr + row * s_x, out_ptr + row * s_out
    cols = tl.arange(0, BLOCK)
    lanes = tl.zeros((BLOCK,), tl.float32)
    for c0 in range(0, N, BLOCK):
        x = tl.load(x_row + c0 + cols, mask=c0 + cols < N, other=0.0).to(tl.float32)
        lanes += x * x
    denom = tl.sqrt_rn(tl.div_rn(tl.sum(lanes, axis=0), N.to(tl.float32)) + eps)
    for c0 in range(0, N, BLOCK):
        x = tl.load(x_row + c0 + cols, mask=c0 + cols < N, other=0.0).to(tl.float32)
        y = tl.div_rn(x, denom)
        tl.store(out_row + c0 + cols, y.to(out_ptr.dtype.element_ty), mask=c0 + cols < N)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    batch, m, k = a.shape
    n = b.shape[2]
    out = torch.empty(batch, m, n, dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), batch)
    _bmm_kernel[grid](a, b, out, m, n, k, *a.stride(), *b.stride(), *out.stride(),
                      PRECISION=precision, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., N) as (R, N) with unit column stride."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _row_op(x: torch.Tensor, mode: int) -> torch.Tensor:
    rows = _rows(x)
    width = 1 if mode == ROW_SUM else rows.shape[1]
    out = torch.empty(rows.shape[0], width, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _row_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), out.stride(0),
                                      MODE=mode, BLOCK=ROW_BLOCK)
    return out.view(*x.shape[:-1], width)


def _rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0),
                                           out.stride(0), eps, BLOCK=ROW_BLOCK)
    return out.view(x.shape)


# Autograd: the trainer backpropagates through the batch-invariant forward. Backward passes
# need no invariance, so they are plain torch math on the saved tensors.
class _Bmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return _bmm(a, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return grad @ b.transpose(1, 2).to(grad.dtype), a.transpose(1, 2).to(grad.dtype) @ grad


class _RowOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mode: int) -> torch.Tensor:
        out = _row_op(x, mode)
        ctx.mode, ctx.shape, ctx.dtype = mode, x.shape, x.dtype
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (out,) = ctx.saved_tensors
        if ctx.mode == ROW_SUM:
            dx = grad.expand(ctx.shape)
        elif ctx.mode == LOG_SOFTMAX:
            dx = grad - out.exp() * grad.sum(-1, keepdim=True)
        else:
            dx = out * (grad - (grad * out).sum(-1, keepdim=True))
        return dx.to(ctx.dtype), None


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.eps = eps
        return _rms_norm(x, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        xf, g = x.float(), grad.float()
        r = torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
        y = xf / r
        return ((g - y * (g * y).mean(-1, keepdim=True)) / r).to(x.dtype), None


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B, M, K) @ (B, K, N) -> (B, M, N) in a's dtype; any strides (transposes are free)."""
    return _Bmm.apply(a, b)  # type: ignore[no-any-return]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T -> (..., N), without a bias."""
    rows = x.reshape(1, -1, x.shape[-1])
    return bmm(rows, weight.t().unsqueeze(0))[0].reshape(*x.shape[:-1], weight.shape[0])


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dim, float32."""
    return _RowOp.apply(x, LOG_SOFTMAX)  # type: ignore[no-any-return]


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, float32."""
    return _RowOp.apply(x, SOFTMAX)  # type: ignore[no-any-return]


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (keepdim), float32."""
    return _RowOp.apply(x, ROW_SUM)  # type: ignore[no-any-return]


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) per row over the last dim, in x's dtype (no weight)."""
    return _RmsNorm.apply(x, eps)  # type: ignore[no-any-return]
