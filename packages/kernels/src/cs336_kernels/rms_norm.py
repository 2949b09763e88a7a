"""RMSNorm (Zhang & Sennrich, 2019) forward and backward in Triton, with the numerics of ``cs336_basics``.

For each row x of length d, in fp32 whatever the input dtypes:

    rstd = rsqrt(mean(x^2) + eps),   y = (x * rstd * w).to(x.dtype)

which is what ``cs336_basics.model.RMSNorm.forward`` computes: it upcasts x, and ``x * rms * weight`` promotes a
bf16/fp16 weight to fp32 (FSDP hands the norm a weight in the compute dtype), so the product is rounded once.
A float64 weight is rounded to fp32 inside the kernel (the module would multiply in float64 before the cast).

Forward: one program per row; it stores y and the row's rstd (fp32). Only x and rstd are saved for the
backward, never the normalised x. Backward, with g = dy * w in fp32 and xhat = x * rstd:

    dx = rstd * (g - xhat * mean(g * xhat)),   dw = sum over rows of dy * xhat

A fixed number of programs (two per SM on CUDA) each walk a contiguous block of rows, compute dx row by row and
keep their share of dw in an fp32 register accumulator; the (programs, d) fp32 partial sums are then reduced by
one ``sum`` and returned in the weight's dtype.

    y = rms_norm(x, weight, eps=1e-5)      # x (..., d) fp32/fp16/bf16, weight (d,)

``rms_norm_reference`` is the module's formula in plain PyTorch (any dtype, float64 for the tests' oracle); tests
and benchmarks import it.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
import triton
import triton.language as tl

from cs336_kernels._callable_module import CallableModule
from cs336_kernels.interpreter import check_device

X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# A row is one block of registers; beyond this the per-thread share spills (and Triton caps a block at 2**20).
MAX_D = 65536
# The interpreter runs programs one after another: a few are enough to exercise the partial sums.
_INTERPRET_PROGRAMS = 3


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD,  # x (rows, D) with row stride stride_x, w (D,), y (rows, D) contiguous, rstd (rows,) fp32
    stride_x, D, eps,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * D + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,  # dy, x (rows, D) strided; dx (rows, D) contiguous; partial (programs, D) fp32
    stride_dy, stride_x, n_rows, rows_per_program, D,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 bounds make the row offsets int64
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / D))
        tl.store(DX + row * D + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW_PARTIAL + pid * D + cols, dw, mask=mask)


def launch_settings(d: int) -> tuple[int, int]:
    """(BLOCK_D, num_warps): the row padded to a power of two, about 16 fp32 values per thread."""
    block_d = triton.next_power_of_2(d)
    return block_d, min(32, max(4, block_d // 512))


@functools.cache
def _num_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRET_PROGRAMS
    # Two per SM: a program holds x, dy, w and its dw share in registers (124 per thread at d = 4096 and 8 warps,
    # packages/kernels/tests/sm90_builds.py), so two fit on an SM and one's loads overlap the other's reduction.
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _device_context(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on x (rows, d) with unit column stride; returns y (rows, d) in x's dtype,
    contiguous, and rstd (rows,) fp32."""
    rows, d = x.shape
    y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block_d, num_warps = launch_settings(d)
        with _device_context(x):
            _rms_norm_fwd_kernel[(rows,)](x, weight, y, rstd, x.stride(0), d, eps, BLOCK_D=block_d,
                                          num_warps=num_warps)
    return y, rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel; dy and x are (rows, d) with unit column strides. Returns dx (rows, d) in x's
    dtype and dw (d,) in the weight's dtype, reduced in fp32."""
    rows, d = x.shape
    dx = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    programs = max(1, min(_num_programs(x.device), rows))
    partial = torch.zeros((programs, d), dtype=torch.float32, device=x.device)
    if rows:
        block_d, num_warps = launch_settings(d)
        with _device_context(x):
            _rms_norm_bwd_kernel[(programs,)](dy, x, weight, rstd, dx, partial, dy.stride(0), x.stride(0), rows,
                                              triton.cdiv(rows, programs), d, BLOCK_D=block_d, num_warps=num_warps)
    return dx, partial.sum(0).to(weight.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, d) with unit stride on d: a view where the layout allows, else a copy."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


class RMSNormFunction(torch.autograd.Function):
    """y = rms_norm(x, weight, eps) for x (..., d) and weight (d,); saves x, weight and rstd (rows,) fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = _rows(x)
        y, rstd = rms_norm_forward(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(_rows(dy), x2, weight, rstd)
        return dx.view(dy.shape), dw if ctx.needs_input_grad[1] else None, None


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in X_DTYPES:
        raise TypeError(f"x must have a dtype in {X_DTYPES}, got {x.dtype}")
    if weight.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"weight must have a dtype in {WEIGHT_DTYPES}, got {weight.dtype}")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"x must be (..., d) and weight (d,); got x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}")
    if not 1 <= x.shape[-1] <= MAX_D:
        raise ValueError(f"d must be in [1, {MAX_D}], got {x.shape[-1]}")
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on one device, got {x.device} and {weight.device}")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMS-normalise the last dim of ``x`` and scale by ``weight`` (Triton, differentiable).

    Args:
        x: (..., d) in fp32, fp16 or bf16, d <= 65536; any strides (a copy is made unless rows are views
            with a unit stride on d).
        weight: (d,) in fp32, fp16, bf16 or fp64 (used in fp32).
        eps: added to the mean square before the rsqrt.

    Returns:
        (..., d) contiguous, in x's dtype; its gradient for the weight comes back in the weight's dtype.
    """
    _check_inputs(x, weight, eps)
    check_device(x.device, "rms_norm")
    return RMSNormFunction.apply(x, weight, float(eps))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``cs336_basics.model.RMSNorm.forward`` for any dtype: statistics in fp32 (float64 for float64 x)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    rstd = torch.rsqrt(xa.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xa * rstd * weight).to(x.dtype)


sys.modules[__name__].__class__ = CallableModule
