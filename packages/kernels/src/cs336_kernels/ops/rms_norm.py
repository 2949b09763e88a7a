"""RMSNorm (Zhang & Sennrich, 2019) forward and backward in Triton, with the numerics of ``cs336_basics``.

For each row x of length d, in fp32 whatever the input dtypes:

    rstd = rsqrt(mean(x^2) + eps),   y = (x * rstd * w).to(x.dtype)

which is what ``cs336_basics.model.RMSNorm.forward`` computes: it upcasts x, and ``x * rms * weight`` promotes a
bf16/fp16 weight to fp32 (FSDP hands the norm a weight in the compute dtype), so the product is rounded once.
A float64 weight is rounded to fp32 inside the kernel (the module would multiply in float64 before the cast).

Only x and rstd (fp32, one per row) are saved for the backward, never the normalised x. Backward, with
g = dy * w in fp32 and xhat = x * rstd:

    dx = rstd * (g - xhat * mean(g * xhat)),   dw = sum over rows of dy * xhat

Both directions are bound by memory traffic: per row the forward reads x and writes y, the backward reads x and dy
and writes dx (8 KB and 16 KB read per row at d = 4096 in bf16). A row's reduction cannot start before all of the
row has arrived, and its stores wait for the reduction, so a program that loads one row at a time leaves DRAM idle
while it reduces; keeping it busy takes, per SM, about (bandwidth x latency / SMs) bytes of loads in flight at all
times. So both kernels are persistent and software-pipelined: ``programs_per_sm`` programs per SM each walk blocks
of ``block_rows`` rows (program p takes blocks p, p + programs, ...), and the loop is ``tl.range`` with
``num_stages``, so the loads of the next ``stages - 1`` blocks travel to shared memory (cp.async) while the current
block is reduced and stored. At d = 4096 the backward holds w, its dw share and one row of x and dy in fp32
registers (about 120 per thread at 8 warps, ``tests/sm90_builds.py``): two such programs share an SM, and the
pipeline, not more programs, is what keeps rows in flight.

The weight gradient: each program sums its rows' dy * xhat in an fp32 register accumulator and stores it as one row
of a (programs, d) fp32 buffer (every program has rows, so the buffer needs no memset); a second kernel sums those
rows in a fixed order, one program per 32 columns (128 at d = 4096, so no SM walks all of it), and writes dw in the
weight's dtype. That buffer, 4 * programs * d bytes written and read once (4.3 MB at 264 programs and d = 4096), is
all the reduction adds to the traffic of dx: the weight gradient's own kernel reads no row.

Each direction's launch (``Launch``: rows per block, warps, programs per SM, pipeline stages) is a parameter of its
launcher, with defaults from ``launch_settings``; ``tools/glue_sweep.py`` times the alternatives at the proxy's shape
on a GPU.

    y = rms_norm(x, weight, eps=1e-5)      # x (..., d) fp32/fp16/bf16, weight (d,)

The block's first residual add folded into its second norm (``add_rms_norm``): the forward reads x and delta once
and writes h = x + delta and y = rms_norm(h), instead of an add (read 2, write 1) and a norm that reads h again.
h is rounded to the input dtype as PyTorch's add rounds it (one fp32 add, one rounding) and the norm reads that
rounded h. The backward gets dh (h's gradient from the residual path) with dy and returns

    dx = (dx_norm rounded to the dtype + dh) rounded to the dtype

as the gradient of both x and delta: the rounding of the norm's own gradient, then autograd's accumulation of the
two gradients of h, so the result is bit for bit the unfused add, ``rms_norm`` and autograd's sum. Both directions
are the kernels above with an ``ADD`` constexpr, launched as ``rms_norm`` launches them: the same layout reduces
each row in the same order, and the same programs take the same rows, so dw's partial sums are the same too.

    h, y = add_rms_norm(x, delta, weight, eps=1e-5)

Two variants for other models' norms, each a keyword of ``rms_norm`` (a runtime scalar and a constexpr of the same
kernels): ``offset`` scales by ``offset + w`` (Gemma's ``1 + w``, added in fp32), and ``cast_before_weight`` rounds
x * rstd to x's dtype before the weight multiplies it (Hugging Face Llama, Qwen and Mistral:
``weight * hidden.to(input_dtype)``), so the product is rounded twice as there; the weight's gradient then sums
dy times that rounded value, as autograd of that formula does.

    y = rms_norm(x, weight, eps=1e-6, cast_before_weight=True)   # LlamaRMSNorm; also Qwen3's per-head q/k norm

``rms_norm_reference`` and ``add_rms_norm_reference`` are the model's formulas in plain PyTorch (any dtype,
float64 for the tests' oracle); tests and benchmarks import them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

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
# Default values per loop iteration (backward, forward): short rows are batched until a block holds this many.
_BLOCK_VALUES = {True: 4096, False: 8192}
# Blocks of up to this many values are pipelined by default, the backward 3 deep (two programs per SM) and the
# forward 4 deep (one program per SM): the blocks ahead of every loaded tensor fit in an SM's shared memory (at most
# 2 programs x 2 blocks x 3 tensors x 4096 x 4 B = 192 KiB in the folded add's fp32 backward, 3 blocks x 2 tensors
# x 8192 x 4 B = 192 KiB in its forward); a longer row puts enough bytes in flight by itself.
_PIPELINED_VALUES = 8192
# The weight-gradient reduction: columns per program (d = 4096 gives 128 programs, about one per SM of an
# H100/H200, each reading its columns of every partial sum) and partial sums per loop iteration.
_REDUCE_COLUMNS = 32
_REDUCE_PARTIALS = 64


@dataclass(frozen=True)
class Launch:
    """How a forward or backward kernel is launched. Both are persistent: ``programs_per_sm`` programs per SM
    (fewer when there are fewer row blocks) walk the row blocks ``block_rows`` at a time, program p taking blocks
    p, p + programs, ..., and the loop over them is software-pipelined ``stages`` deep (``tl.range``'s
    ``num_stages``: the loads of the next ``stages - 1`` blocks are in flight, through shared memory, while the
    current block is reduced and stored; 1 is no pipelining)."""

    block_rows: int
    num_warps: int
    programs_per_sm: int
    stages: int

    def __post_init__(self) -> None:
        for name in ("block_rows", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.num_warps > 32:
            raise ValueError(f"num_warps must be at most 32, got {self.num_warps}")
        for name in ("programs_per_sm", "stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def launch_settings(d: int, backward: bool) -> Launch:
    """The default launch of the forward or backward kernel for rows of length ``d``: rows shorter than a block
    batched into blocks of about 4,096 values (backward) or 8,192 (forward), 16 values of a block per thread.
    The backward holds a row of x and dy, w and its dw share in fp32 registers (about 120 per thread at d = 4096,
    8 warps), runs two programs per SM and keeps two blocks in flight ahead of the one being reduced. The forward
    holds two rows of x and w (16 warps) and runs one program per SM with three blocks ahead: at d = 4096 in bf16
    either keeps 48-96 KB of loads in flight per SM. The forward's choice is the fastest resident launch of the
    sweep (`tools/glue_sweep.py`, rows of call s17e in `writeup/results/glue_sweep.jsonl`)."""
    block_d = triton.next_power_of_2(d)
    block_rows = max(1, _BLOCK_VALUES[backward] // block_d)
    num_warps = min(32, max(4, block_rows * block_d // 512))
    pipelined = block_rows * block_d <= _PIPELINED_VALUES
    if backward:
        return Launch(block_rows, num_warps, programs_per_sm=2, stages=3 if pipelined else 1)
    return Launch(block_rows, num_warps, programs_per_sm=1, stages=4 if pipelined else 1)


@triton.jit
def _rms_norm_fwd_kernel(
    X, DELTA, W, H, Y, RSTD,  # x, delta (rows, D) strided; w (D,); h, y (rows, D) contiguous; rstd (rows,) fp32
    stride_x, stride_delta, n_rows, D, eps, offset,  # the scale is offset + w
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
    ADD: tl.constexpr,  # normalise h = x + delta and store h; otherwise DELTA and H are None
    CAST_FIRST: tl.constexpr,  # round x * rstd to the dtype before the weight multiplies it
):
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    w = (tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset)[None, :]
    for start in tl.range(tl.program_id(0) * BLOCK_ROWS, n_rows, tl.num_programs(0) * BLOCK_ROWS,
                          num_stages=STAGES):
        rows = (start + tl.arange(0, BLOCK_ROWS)).to(tl.int64)  # int64 offsets
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        if ADD:
            # PyTorch's add: one fp32 add, one rounding to the dtype; the norm then reads the rounded h, as ln2 does.
            delta = tl.load(DELTA + rows[:, None] * stride_delta + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(H.dtype.element_ty)
            tl.store(H + rows[:, None] * D + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        xhat = x * rstd[:, None]
        if CAST_FIRST:
            xhat = xhat.to(Y.dtype.element_ty).to(tl.float32)
        y = xhat * w
        tl.store(Y + rows[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, DH, X, W, RSTD, DX, DW_PARTIAL,  # dy, dh, x (rows, D) strided; dx (rows, D) contiguous; (programs, D) fp32
    stride_dy, stride_dh, stride_x, n_rows, D, offset,  # the scale is offset + w
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
    ADD: tl.constexpr,  # dx = rounded dx_norm + dh (x is then h); otherwise DH is None
    CAST_FIRST: tl.constexpr,  # the forward rounded x * rstd before the weight: dw sums dy times that rounded value
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    w = (tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset)[None, :]
    # One accumulator row per block row: summing over the block's rows every iteration would cost a cross-warp
    # reduction per block; they are summed once, after the loop.
    dw = tl.zeros((BLOCK_ROWS, BLOCK_D), tl.float32)
    for start in tl.range(pid * BLOCK_ROWS, n_rows, tl.num_programs(0) * BLOCK_ROWS, num_stages=STAGES):
        rows = (start + tl.arange(0, BLOCK_ROWS)).to(tl.int64)  # int64 offsets
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)[:, None]  # 0 past the last row: xhat = 0 there
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=1) / D)[:, None])
        if ADD:
            # Autograd rounds the norm's gradient to the dtype, then adds the residual's (fp32 add, one rounding).
            dh = tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dx = dx.to(DX.dtype.element_ty).to(tl.float32) + dh
        tl.store(DX + rows[:, None] * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if CAST_FIRST:
            xhat = xhat.to(DX.dtype.element_ty).to(tl.float32)
        dw += dy * xhat
    tl.store(DW_PARTIAL + pid * D + cols, tl.sum(dw, axis=0), mask=col_mask)


@triton.jit
def _dw_reduce_kernel(
    PARTIAL, DW,  # (n_partials, D) fp32 partial sums; dw (D,) in the weight's dtype
    n_partials, D,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < D
    # Each iteration's loads are independent of the running sums, so they pipeline; one sum over the block's
    # rows at the end, in a fixed order (the weight gradient is the same on every run).
    acc = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
    for p0 in tl.range(0, n_partials, BLOCK_P, num_stages=3):
        p = p0 + tl.arange(0, BLOCK_P)
        mask = (p < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(PARTIAL + p[:, None] * D + cols[None, :], mask=mask, other=0.0)
    tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=col_mask)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_programs(launch: Launch, rows: int, device: torch.device) -> int:
    """Programs of a persistent launch over ``rows`` rows: ``launch.programs_per_sm`` per SM (3 in the
    interpreter), at most one per row block and at least one."""
    per_device = launch.programs_per_sm * _sm_count(device) if device.type == "cuda" else _INTERPRET_PROGRAMS
    return max(1, min(per_device, triton.cdiv(rows, launch.block_rows)))


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
                     launch: Launch | None = None, *, offset: float = 0.0,
                     cast_before_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel on x (rows, d) with unit column stride, or with ``delta`` (the same shape, dtype
    and column stride) on h = x + delta; ``launch`` defaults to ``launch_settings(d, backward=False)``; ``offset``
    and ``cast_before_weight`` as in :func:`rms_norm`. Returns
    y (rows, d) in x's dtype, contiguous, rstd (rows,) fp32, and h (rows, d) contiguous when delta is given, else
    None."""
    rows, d = x.shape
    launch = launch or launch_settings(d, backward=False)
    h = None if delta is None else torch.empty((rows, d), dtype=x.dtype, device=x.device)
    y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        stride_delta = 0 if delta is None else delta.stride(0)
        with device_context(x):
            _rms_norm_fwd_kernel[(num_programs(launch, rows, x.device),)](
                x, delta, weight, h, y, rstd, x.stride(0), stride_delta, rows, d, eps, offset,
                BLOCK_ROWS=launch.block_rows, BLOCK_D=triton.next_power_of_2(d), STAGES=launch.stages,
                ADD=delta is not None, CAST_FIRST=cast_before_weight, num_warps=launch.num_warps)
    return y, rstd, h


def rms_norm_backward_rows(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                           dh: torch.Tensor | None = None, launch: Launch | None = None, *, offset: float = 0.0,
                           cast_before_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward kernel alone: dx (as :func:`rms_norm_backward`) and the weight gradient's fp32 partial sums,
    one row per program, ``(programs, d)``. ``launch`` defaults to ``launch_settings(d, backward=True)``."""
    rows, d = x.shape
    launch = launch or launch_settings(d, backward=True)
    dx = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if not rows:
        return dx, torch.zeros((1, d), dtype=torch.float32, device=x.device)
    programs = num_programs(launch, rows, x.device)
    # Every program has a row block and stores its whole partial sum: no memset.
    partial = torch.empty((programs, d), dtype=torch.float32, device=x.device)
    stride_dh = 0 if dh is None else dh.stride(0)
    with device_context(x):
        _rms_norm_bwd_kernel[(programs,)](
            dy, dh, x, weight, rstd, dx, partial, dy.stride(0), stride_dh, x.stride(0), rows, d, offset,
            BLOCK_ROWS=launch.block_rows, BLOCK_D=triton.next_power_of_2(d), STAGES=launch.stages,
            ADD=dh is not None, CAST_FIRST=cast_before_weight, num_warps=launch.num_warps)
    return dx, partial


def reduce_weight_grad(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight gradient (d,) in ``dtype`` from the backward kernel's fp32 partial sums (programs, d), summed in
    fp32 in a fixed order by one small kernel (no fp32 intermediate, no separate cast)."""
    n_partials, d = partial.shape
    dw = torch.empty(d, dtype=dtype, device=partial.device)
    with device_context(partial):
        _dw_reduce_kernel[(triton.cdiv(d, _REDUCE_COLUMNS),)](partial, dw, n_partials, d, BLOCK_P=_REDUCE_PARTIALS,
                                                             BLOCK_N=_REDUCE_COLUMNS, num_warps=4)
    return dw


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      dh: torch.Tensor | None = None, launch: Launch | None = None, *, offset: float = 0.0,
                      cast_before_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel and the weight gradient's reduction; dy and x (h for the add) are (rows, d) with
    unit column strides, and so is ``dh``, the gradient reaching h from elsewhere, when the add was folded in.
    Returns dx (rows, d) in x's dtype (with dh: the gradient of both x and delta) and dw (d,) in the weight's dtype,
    reduced in fp32."""
    dx, partial = rms_norm_backward_rows(dy, x, weight, rstd, dh, launch, offset=offset,
                                         cast_before_weight=cast_before_weight)
    return dx, reduce_weight_grad(partial, weight.dtype)


# The operators. Each takes and returns tensors of the caller's shapes (x (..., d), rstd (...)); outputs are new
# tensors, never views of inputs, as torch.library requires.
@torch.library.custom_op("cs336::rms_norm_forward", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                cast_before_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """y = rms_norm(x, weight, eps, offset=offset, cast_before_weight=cast_before_weight) and the rows' rstd (fp32),
    as ``torch.ops.cs336.rms_norm_forward``."""
    y, rstd, _ = rms_norm_forward(as_rows(x), weight, eps, offset=offset, cast_before_weight=cast_before_weight)
    return y.view(x.shape), rstd.view(x.shape[:-1])


@rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
      cast_before_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
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
                         dh: torch.Tensor | None, offset: float = 0.0,
                         cast_before_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of the norm of x (h when ``dh``, the residual's gradient of h, is given: dx is then the gradient of
    both x and delta), as ``torch.ops.cs336.rms_norm_backward``."""
    dh_rows = None if dh is None else as_rows(dh)
    dx, dw = rms_norm_backward(as_rows(dy), as_rows(x), weight, rstd.reshape(-1), dh=dh_rows, offset=offset,
                               cast_before_weight=cast_before_weight)
    return dx.view(x.shape), dw


@rms_norm_backward_op.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dh: torch.Tensor | None,
      offset: float = 0.0, cast_before_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_norm(ctx, inputs: tuple, output: tuple) -> None:
    x, weight, _, offset, cast_before_weight = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset, ctx.cast_before_weight = offset, cast_before_weight


def _norm_backward(ctx, dy: torch.Tensor, _drstd: torch.Tensor):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(dy, x, weight, rstd, None, ctx.offset, ctx.cast_before_weight)
    return dx, dw if ctx.needs_input_grad[1] else None, None, None, None


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


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> None:
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
    if isinstance(offset, bool) or not isinstance(offset, int | float) or not math.isfinite(offset):
        raise ValueError(f"offset must be a finite float, got {offset!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *, offset: float = 0.0,
             cast_before_weight: bool = False) -> torch.Tensor:
    """RMS-normalise the last dim of ``x`` and scale by ``offset + weight`` (Triton, differentiable).

    Args:
        x: (..., d) in fp32, fp16 or bf16, d <= 65536; any strides (a copy is made unless rows are views
            with a unit stride on d). Qwen3's per-head q/k norm is x (batch, seq, heads, head_dim).
        weight: (d,) in fp32, fp16, bf16 or fp64 (used in fp32).
        eps: added to the mean square before the rsqrt.
        offset: added to the weight in fp32 (Gemma's ``1 + w``: 1.0).
        cast_before_weight: round x * rstd to x's dtype before the weight multiplies it (Hugging Face Llama, Qwen,
            Mistral); otherwise the product is rounded once (``cs336_basics``, Gemma).

    Returns:
        (..., d) contiguous, in x's dtype; its gradient for the weight comes back in the weight's dtype.
    """
    _check_inputs(x, weight, eps, offset)
    check_device(x.device, "rms_norm")
    return rms_norm_op(x, weight, float(eps), float(offset), bool(cast_before_weight))[0]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *, offset: float = 0.0,
                       cast_before_weight: bool = False) -> torch.Tensor:
    """``cs336_basics.model.RMSNorm.forward`` for any dtype: statistics in fp32 (float64 for float64 x); with
    ``cast_before_weight`` Hugging Face's ``LlamaRMSNorm.forward``, with ``offset`` Gemma's ``1 + w``."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    xhat = xa * torch.rsqrt(xa.pow(2).mean(dim=-1, keepdim=True) + eps)
    scale = weight.to(torch.promote_types(weight.dtype, torch.float32)) + offset if offset else weight
    if cast_before_weight:
        return (scale * xhat.to(x.dtype)).to(x.dtype)
    return (xhat * scale).to(x.dtype)


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


