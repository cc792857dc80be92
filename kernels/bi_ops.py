"""Batch-invariant CPU ops: one row's result never depends on the other rows computed with it.

Why the stock ops are not invariant on CPU (measured on AVX-512, torch 2.13, MKL):
- ``F.linear`` picks a different GEMM kernel for small or ragged M (M = 1 is a GEMV; M in
  5..11 hits edge kernels), so a token's projection changes with the batch size.
- Vectorised ``sigmoid``/``silu``/``rsqrt`` differ in the last bit from the scalar loop ATen
  runs on the tail of a tensor, so a value's result depends on where it sits in the tensor.
  ``exp``, ``log``, ``sqrt``, ``sin``, ``cos`` agree bit for bit in both paths.

The cures, each with a plain reference of the same signature (``*_reference``) for parity tests:
- ``bi_linear`` pads M up to a multiple of ``ROW_TILE`` rows, so every GEMM call runs the same
  full-tile kernel whose K blocking depends only on K, never on M or the thread count.
- ``bi_silu`` and ``bi_rms_norm`` use only ops whose vector and scalar paths agree.
- Row reductions over the last dim (mean, softmax, log-softmax) use ATen's row kernels on
  contiguous rows: ATen splits such reductions across rows, never inside a row shorter than its
  grain size (32768), so each row is reduced by the same code whatever the number of rows.
tests/kernels/test_batch_invariant.py holds each claim (parity and bitwise invariance).

CUDA tensors go to the Triton kernels of ``kernels.triton_ops`` instead (fixed tiles, no split-K,
one program per row); triton is imported on the first CUDA call only, so CPU runs never load it.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

ROW_TILE = 16  # GEMM calls always see M % ROW_TILE == 0 (full micro-tiles; see module doc)


class BatchInvariantUnsupported(NotImplementedError):
    """A model layout or device the batch-invariant mode refuses rather than get wrong."""


def triton_kernels() -> ModuleType:
    """``kernels.triton_ops`` (imports triton): the batch-invariant kernels for CUDA tensors."""
    try:
        from kernels import triton_ops
    except ImportError as exc:
        raise BatchInvariantUnsupported(
            "batch-invariant ops on CUDA need triton (pip install triton)") from exc
    return triton_ops


def bi_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` whose rows are bitwise independent of how many rows are computed together."""
    if x.is_cuda:
        out = triton_kernels().linear(x, weight)
    else:
        rows = x.reshape(-1, x.shape[-1])  # (M, K)
        m = rows.shape[0]
        padded = max(ROW_TILE, -(-m // ROW_TILE) * ROW_TILE)
        if padded != m:
            rows = F.pad(rows, (0, 0, 0, padded - m))
        out = F.linear(rows, weight)[:m].reshape(*x.shape[:-1], weight.shape[0])  # (..., N)
    if bias is not None:
        out = out + bias  # a separate elementwise add: exact and position-independent
    return out


def bi_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B, M, K) @ (B, K, N). On CPU ``torch.bmm``: callers keep M a multiple of ROW_TILE and
    K fixed; on CUDA the fixed-tile Triton GEMM, invariant for any M."""
    return triton_kernels().bmm(a, b) if a.is_cuda else torch.bmm(a, b)


def bi_row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, keepdim (CPU: ATen's row kernel on contiguous rows)."""
    if x.is_cuda:
        return triton_kernels().row_sum(x).to(x.dtype)
    return x.sum(-1, keepdim=True)


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Stock linear, the reference for ``bi_linear``."""
    return F.linear(x, weight, bias)


def bi_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU from exp and division (both exact in vector and scalar paths), not ATen's silu.
    In place only where autograd does not keep exp's result for the backward."""
    e = torch.exp(-x)
    return x / (e + 1.0 if torch.is_grad_enabled() else e.add_(1.0))


def silu_reference(x: torch.Tensor) -> torch.Tensor:
    """Stock SiLU, the reference for ``bi_silu``."""
    return F.silu(x)


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen/Llama RMSNorm with a per-row mean and ``1/sqrt`` instead of the vectorised rsqrt."""
    if x.is_cuda:
        return weight * triton_kernels().rms_norm(x, eps)
    xf = x.float().contiguous()
    variance = xf.pow(2).mean(-1, keepdim=True)  # (..., 1), one row kernel per row
    normed = xf / torch.sqrt(variance + eps)
    return weight * normed.to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm forward, the reference for ``bi_rms_norm``."""
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def _as_rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, bool]:
    """Move ``dim`` last and make rows contiguous float32, so the row kernel sees one layout."""
    moved = dim not in (-1, x.dim() - 1)
    rows = x.movedim(dim, -1) if moved else x
    return rows.float().contiguous(), moved


def bi_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax in float32 over contiguous rows (ATen's per-row kernel: row-count invariant)."""
    rows, moved = _as_rows(x, dim)
    out = triton_kernels().softmax(rows) if x.is_cuda else torch.softmax(rows, dim=-1)
    return out.movedim(-1, dim) if moved else out


def bi_log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Log-softmax in float32 over contiguous rows (ATen's per-row kernel: row-count invariant)."""
    rows, moved = _as_rows(x, dim)
    out = triton_kernels().log_softmax(rows) if x.is_cuda else torch.log_softmax(rows, dim=-1)
    return out.movedim(-1, dim) if moved else out


def softmax_reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Stock softmax, the reference for ``bi_softmax``."""
    return torch.softmax(x.float(), dim=dim)


def log_softmax_reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Stock log-softmax, the reference for ``bi_log_softmax``."""
    return torch.log_softmax(x.float(), dim=dim)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``tokens`` under ``logits``; the one function engine and trainer share.

    logits (..., V), tokens (...) int64 -> (...) float32. Row-count invariant, so the engine's
    per-step value equals the trainer's full-sequence value when the logits are equal.
    """
    logp = bi_log_softmax(logits, dim=-1)  # (..., V)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
