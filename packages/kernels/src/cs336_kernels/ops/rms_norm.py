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

The block's first residual add folded into its second norm (``add_rms_norm``): the forward reads x and delta once
and writes h = x + delta and y = rms_norm(h), instead of an add (read 2, write 1) and a norm that reads h again.
h is rounded to the input dtype as PyTorch's add rounds it (one fp32 add, one rounding) and the norm reads that
rounded h. The backward gets dh (h's gradient from the residual path) with dy and returns

    dx = (dx_norm rounded to the dtype + dh) rounded to the dtype

as the gradient of both x and delta: the rounding of the norm's own gradient, then autograd's accumulation of the
two gradients of h, so the result is bit for bit the unfused add, ``rms_norm`` and autograd's sum. Both directions
are the kernels above with an ``ADD`` constexpr (one kernel per direction).

    h, y = add_rms_norm(x, delta, weight, eps=1e-5)

``rms_norm_reference`` and ``add_rms_norm_reference`` are the model's formulas in plain PyTorch (any dtype,
float64 for the tests' oracle); tests and benchmarks import them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cs336_kernels.interpreter import check_device
from cs336_kernels.ops._common import as_rows, device_context

X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# A row is one block of registers; beyond this the per-thread share spills (and Triton caps a block at 2**20).
MAX_D = 65536
# The interpreter runs programs one after another: a few are enough to exercise the partial sums.
_INTERPRET_PROGRAMS = 3


@triton.jit
def _rms_norm_fwd_kernel(
    X, DELTA, W, H, Y, RSTD,  # x, delta (rows, D) strided; w (D,); h, y (rows, D) contiguous; rstd (rows,) fp32
    stride_x, stride_delta, D, eps,
    BLOCK_D: tl.constexpr,
    ADD: tl.constexpr,  # normalise h = x + delta and store h; otherwise DELTA and H are None
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        # PyTorch's add: one fp32 add, one rounding to the dtype; the norm then reads the rounded h, as ln2 does.
        delta = tl.load(DELTA + row * stride_delta + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + row * D + cols, x, mask=mask)
    x = x.to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * D + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, DH, X, W, RSTD, DX, DW_PARTIAL,  # dy, dh, x (rows, D) strided; dx (rows, D) contiguous; (programs, D) fp32
    stride_dy, stride_dh, stride_x, n_rows, rows_per_program, D,
    BLOCK_D: tl.constexpr,
    ADD: tl.constexpr,  # dx = rounded dx_norm + dh (x is then h); otherwise DH is None
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
        if ADD:
            # Autograd rounds the norm's gradient to the dtype, then adds the residual's (fp32 add, one rounding).
            dh = tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
            dx = dx.to(DX.dtype.element_ty).to(tl.float32) + dh
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


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel on x (rows, d) with unit column stride, or with ``delta`` (the same shape, dtype
    and column stride) on h = x + delta. Returns y (rows, d) in x's dtype, contiguous, rstd (rows,) fp32, and h
    (rows, d) contiguous when delta is given, else None."""
    rows, d = x.shape
    h = None if delta is None else torch.empty((rows, d), dtype=x.dtype, device=x.device)
    y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block_d, num_warps = launch_settings(d)
        stride_delta = 0 if delta is None else delta.stride(0)
        with device_context(x):
            _rms_norm_fwd_kernel[(rows,)](x, delta, weight, h, y, rstd, x.stride(0), stride_delta, d, eps,
                                           BLOCK_D=block_d, ADD=delta is not None, num_warps=num_warps)
    return y, rstd, h


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      dh: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel; dy and x (h for the add) are (rows, d) with unit column strides, and so is
    ``dh``, the gradient reaching h from elsewhere, when the add was folded in. Returns dx (rows, d) in x's dtype
    (with dh: the gradient of both x and delta) and dw (d,) in the weight's dtype, reduced in fp32."""
    rows, d = x.shape
    dx = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    programs = max(1, min(_num_programs(x.device), rows))
    partial = torch.zeros((programs, d), dtype=torch.float32, device=x.device)
    if rows:
        block_d, num_warps = launch_settings(d)
        stride_dh = 0 if dh is None else dh.stride(0)
        with device_context(x):
            _rms_norm_bwd_kernel[(programs,)](dy, dh, x, weight, rstd, dx, partial, dy.stride(0), stride_dh,
                                              x.stride(0), rows, triton.cdiv(rows, programs), d, BLOCK_D=block_d,
                                              ADD=dh is not None, num_warps=num_warps)
    return dx, partial.sum(0).to(weight.dtype)


# The operators. Each takes and returns tensors of the caller's shapes (x (..., d), rstd (...)); outputs are new
# tensors, never views of inputs, as torch.library requires.
@torch.library.custom_op("cs336::rms_norm_forward", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y = rms_norm(x, weight, eps) and the rows' rstd (fp32), as ``torch.ops.cs336.rms_norm_forward``."""
    y, rstd, _ = rms_norm_forward(as_rows(x), weight, eps)
    return y.view(x.shape), rstd.view(x.shape[:-1])


@rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("cs336::add_rms_norm_forward", mutates_args=())
def add_rms_norm_op(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = x + delta, y = rms_norm(h, weight, eps) and the rows' rstd, as ``torch.ops.cs336.add_rms_norm_forward``."""
    y, rstd, h = rms_norm_forward(as_rows(x), weight, eps, delta=as_rows(delta))
    return h.view(x.shape), y.view(x.shape), rstd.view(x.shape[:-1])


@add_rms_norm_op.register_fake
def _(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("cs336::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                         dh: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of the norm of x (h when ``dh``, the residual's gradient of h, is given: dx is then the gradient of
    both x and delta), as ``torch.ops.cs336.rms_norm_backward``."""
    dh_rows = None if dh is None else as_rows(dh)
    dx, dw = rms_norm_backward(as_rows(dy), as_rows(x), weight, rstd.reshape(-1), dh=dh_rows)
    return dx.view(x.shape), dw


@rms_norm_backward_op.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
      dh: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_norm(ctx, inputs: tuple, output: tuple) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _norm_backward(ctx, dy: torch.Tensor, _drstd: torch.Tensor):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(dy, x, weight, rstd, None)
    return dx, dw if ctx.needs_input_grad[1] else None, None


def _setup_add_norm(ctx, inputs: tuple, output: tuple) -> None:
    weight = inputs[2]
    h, _, rstd = output
    ctx.save_for_backward(h, weight, rstd)


def _add_norm_backward(ctx, dh: torch.Tensor, dy: torch.Tensor, _drstd: torch.Tensor):
    h, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(dy, h, weight, rstd, dh)
    needs = ctx.needs_input_grad
    return dx if needs[0] else None, dx if needs[1] else None, dw if needs[2] else None, None


rms_norm_op.register_autograd(_norm_backward, setup_context=_setup_norm)
add_rms_norm_op.register_autograd(_add_norm_backward, setup_context=_setup_add_norm)


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
    return rms_norm_op(x, weight, float(eps))[0]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``cs336_basics.model.RMSNorm.forward`` for any dtype: statistics in fp32 (float64 for float64 x)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    rstd = torch.rsqrt(xa.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xa * rstd * weight).to(x.dtype)


def _check_add_inputs(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _check_inputs(x, weight, eps)
    if not isinstance(delta, torch.Tensor):
        raise TypeError(f"delta must be a torch.Tensor, got {type(delta).__name__}")
    if delta.dtype != x.dtype:
        raise TypeError(f"delta must have x's dtype {x.dtype}, got {delta.dtype}")
    if delta.shape != x.shape:
        raise ValueError(f"delta must have x's shape {tuple(x.shape)}, got {tuple(delta.shape)}")
    if delta.device != x.device:
        raise ValueError(f"x and delta must be on one device, got {x.device} and {delta.device}")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one pass each way (Triton, differentiable).

    Args:
        x: (..., d) in fp32, fp16 or bf16, d <= 65536 (the residual stream); any strides.
        delta: what is added to it (the attention's output): x's shape and dtype, any strides.
        weight: (d,) in fp32, fp16, bf16 or fp64 (used in fp32).
        eps: added to the mean square before the rsqrt.

    Returns:
        h = x + delta and y = rms_norm(h, weight, eps), both (..., d) contiguous in x's dtype, bit for bit
        ``h = x + delta`` followed by :func:`rms_norm` (and their gradients as autograd sums them).
    """
    _check_add_inputs(x, delta, weight, eps)
    check_device(x.device, "add_rms_norm")
    h, y, _ = add_rms_norm_op(x, delta, weight, float(eps))
    return h, y


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's ``h = x + delta`` and ``ln2(h)`` in plain PyTorch, for any dtype: (h, rms_norm_reference(h))."""
    h = x + delta
    return h, rms_norm_reference(h, weight, eps)


