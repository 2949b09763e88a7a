"""SwiGLU's gate ``silu(a) * b`` (Shazeer, 2020) forward and backward in Triton, one pass over memory each.

``cs336_basics.model.SwiGLU`` computes ``w2(a * sigmoid(a) * b)`` with a = w1 x and b = w3 x, three PyTorch
ops in the input dtype that each compute in fp32 and round: s = sigmoid(a), t = a * s, out = t * b. The
forward kernel computes in fp32 and rounds at the same three places, so in fp32 it is the same as the
expression and in bf16/fp16 it matches the module's rounding; the only difference is the fp32 sigmoid itself
(the kernel's exp against PyTorch's), which moves a rounded result by one ulp now and then.

The backward recomputes sigmoid from a (nothing but a and b is saved) and, with g the output's gradient:

    db = g * t                                 (t as rounded in the forward, PyTorch's formula)
    da = g * b * s * (1 + a * (1 - s))         (d/da of a * sigmoid(a), fp32, s unrounded)

each rounded once to the input dtype. Here it differs from PyTorch's autograd of the expression, which rounds
four intermediates (g * b, its products with s and with a, sigmoid's backward) and their sum, so da is a little
more accurate than the module's.

Both kernels run on a flat 1-D grid, one block of the row-major (rows, n) elements per program, so only the last
block is masked. Contiguous rows (every operand's rows n apart) are indexed base + i; rows with other strides
(unit column stride, e.g. column slices of a fused w1|w3 output) through row = i // n, col = i - row * n.

    out = silu_mul(a, b)      # a, b (..., n) of one dtype and shape

``silu_mul_reference`` is the module's expression in plain PyTorch; tests and benchmarks import it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cs336_kernels.interpreter import check_device
from cs336_kernels.ops._common import as_rows, device_context

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Elements per program: 16 per thread at 8 warps, two 16-byte loads of bf16 per tensor in flight.
_BLOCK = 4096
_NUM_WARPS = 8
# The strided path indexes within rows in int32, up to n + _BLOCK.
MAX_N = 2**31 - _BLOCK
MAX_NUMEL = (2**31 - 1) * _BLOCK  # one program per block on grid axis 0


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """x rounded to DTYPE and back to fp32 (a no-op for fp32): where PyTorch rounds an intermediate."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _at(X, stride, N, start, idx, ROW_STRIDED: tl.constexpr):
    """Pointers to the elements start + idx, in row-major order, of (rows, N) X with rows ``stride`` apart."""
    if ROW_STRIDED:
        row0 = start // N
        col = (start - row0 * N).to(tl.int32) + idx
        row = col // N
        return X + (row0 + row) * stride + (col - row * N)
    else:
        return X + start + idx


@triton.jit
def _silu_mul_fwd_kernel(
    A, B, OUT,  # a, b (rows, N) with unit column stride, rows stride_a / stride_b apart; out (rows, N) contiguous
    stride_a, stride_b, N, numel,
    BLOCK: tl.constexpr, ROW_STRIDED: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    idx = tl.arange(0, BLOCK)
    mask = idx < numel - start
    a = tl.load(_at(A, stride_a, N, start, idx, ROW_STRIDED), mask=mask, other=0.0)
    b = tl.load(_at(B, stride_b, N, start, idx, ROW_STRIDED), mask=mask, other=0.0).to(tl.float32)
    dtype = a.dtype
    a = a.to(tl.float32)
    t = _rounded(a * _rounded(tl.sigmoid(a), dtype), dtype)
    tl.store(OUT + start + idx, (t * b).to(dtype), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(
    DOUT, A, B, DA, DB,  # dout, a, b (rows, N) with unit column stride and row strides; da, db (rows, N) contiguous
    stride_dout, stride_a, stride_b, N, numel,
    BLOCK: tl.constexpr, ROW_STRIDED: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    idx = tl.arange(0, BLOCK)
    mask = idx < numel - start
    a = tl.load(_at(A, stride_a, N, start, idx, ROW_STRIDED), mask=mask, other=0.0)
    dtype = a.dtype
    a = a.to(tl.float32)
    b = tl.load(_at(B, stride_b, N, start, idx, ROW_STRIDED), mask=mask, other=0.0).to(tl.float32)
    g = tl.load(_at(DOUT, stride_dout, N, start, idx, ROW_STRIDED), mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    t = _rounded(a * _rounded(s, dtype), dtype)
    tl.store(DB + start + idx, (g * t).to(dtype), mask=mask)
    tl.store(DA + start + idx, (g * b * s * (1.0 + a * (1.0 - s))).to(dtype), mask=mask)


def _row_strided(*ts: torch.Tensor) -> bool:
    """Whether the kernels must step rows by their strides: some (rows, n) operand's rows are not n apart."""
    rows, n = ts[0].shape
    return rows > 1 and any(t.stride(0) != n for t in ts)


def _grid(numel: int) -> tuple[int]:
    return (triton.cdiv(numel, _BLOCK),)


def silu_mul_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Launch the forward kernel on (rows, n) a and b with unit column strides; out (rows, n) contiguous."""
    rows, n = a.shape
    out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    if out.numel():
        with device_context(a):
            _silu_mul_fwd_kernel[_grid(out.numel())](a, b, out, a.stride(0), b.stride(0), n, out.numel(),
                                                     BLOCK=_BLOCK, ROW_STRIDED=_row_strided(a, b),
                                                     num_warps=_NUM_WARPS)
    return out


def silu_mul_backward(dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel on (rows, n) tensors with unit column strides; (da, db) contiguous."""
    rows, n = a.shape
    da = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    db = torch.empty_like(da)
    if da.numel():
        with device_context(a):
            _silu_mul_bwd_kernel[_grid(da.numel())](dout, a, b, da, db, dout.stride(0), a.stride(0), b.stride(0), n,
                                                    da.numel(), BLOCK=_BLOCK, ROW_STRIDED=_row_strided(dout, a, b),
                                                    num_warps=_NUM_WARPS)
    return da, db


@torch.library.custom_op("cs336::silu_mul_forward", mutates_args=())
def silu_mul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` for a, b (..., n), contiguous, as ``torch.ops.cs336.silu_mul_forward``."""
    return silu_mul_forward(as_rows(a), as_rows(b)).view(a.shape)


@silu_mul_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape)


@torch.library.custom_op("cs336::silu_mul_backward", mutates_args=())
def silu_mul_backward_op(dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) of ``silu(a) * b`` from the output's gradient, as ``torch.ops.cs336.silu_mul_backward``."""
    da, db = silu_mul_backward(as_rows(dout), as_rows(a), as_rows(b))
    return da.view(a.shape), db.view(a.shape)


@silu_mul_backward_op.register_fake
def _(dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return a.new_empty(a.shape), a.new_empty(a.shape)


def _setup(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)  # a and b only: sigmoid is recomputed in the backward


def _backward(ctx, dout: torch.Tensor):
    return silu_mul_backward_op(dout, *ctx.saved_tensors)


silu_mul_op.register_autograd(_backward, setup_context=_setup)


def _check_inputs(a: torch.Tensor, b: torch.Tensor) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        raise TypeError(f"a and b must share a dtype in {DTYPES}, got {a.dtype} and {b.dtype}")
    if a.shape != b.shape or a.dim() < 1:
        raise ValueError(f"a and b must have one shape (..., n), got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-1] > MAX_N:
        raise ValueError(f"the last dim must be at most {MAX_N}, got {a.shape[-1]}")
    if a.numel() > MAX_NUMEL:
        raise ValueError(f"a and b must have at most {MAX_NUMEL} elements, got {a.numel()}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * sigmoid(a) * b`` with the module's rounding (Triton, differentiable).

    Args:
        a: (..., n) gate pre-activation (w1 x) in fp32, fp16 or bf16; any strides (a copy is made unless
            rows are views with a unit stride on n, as column slices of a fused w1/w3 projection are).
        b: (..., n) linear branch (w3 x), same shape and dtype.

    Returns:
        (..., n) contiguous, in the input dtype.
    """
    _check_inputs(a, b)
    check_device(a.device, "silu_mul")
    return silu_mul_op(a, b)


def silu_mul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``cs336_basics.model.SwiGLU``'s gate, as written there (each op rounds to the input dtype)."""
    return a * torch.sigmoid(a) * b
