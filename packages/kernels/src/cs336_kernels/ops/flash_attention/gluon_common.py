"""What the Gluon (sm_90) attention kernels of :mod:`~cs336_kernels.ops.flash_attention.gluon_forward` and
:mod:`~cs336_kernels.ops.flash_attention.gluon_backward` share: where they apply, their input checks, TMA
descriptors, the wgmma accumulator layout and the register split between producer and consumers.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cs336_kernels.ops.flash_attention.checks import check_inputs as check_portable_inputs
from cs336_kernels.ops.flash_attention.params import Params

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# The head dims each direction takes. Gluon's shapes and TMA boxes are powers of two, so d = 96 runs in 128-column
# tiles: TMA reads the columns past 96 as zeros and drops writes there, at a third more matmul work than d needs.
# The backward has no d = 256: each consumer warpgroup keeps dK and dV of its 64 keys in registers, 2 x 128 fp32 a
# thread there, past the 240 a consumer has (and K, V and a two-stage Q/dO ring alone would fill 256 KiB of shared
# memory).
HEAD_DIMS = {"forward": (64, 96, 128, 256), "backward": (64, 96, 128)}
# 12 warps (two consumer warpgroups and the producer's warpgroup) share 64 K registers per SM: 168 each at
# launch, then setmaxnreg moves them from the producer (24) to the consumers (240).
MAX_REGISTERS = 168
CONSUMER_REGISTERS = gl.constexpr(240)
PRODUCER_REGISTERS = gl.constexpr(24)
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# Gluon builtins that Triton renamed within the supported range (3.6-3.9), under one name each: the barrier of a
# CTA's threads (gl.thread_barrier through 3.6, gl.barrier from 3.7) and the TMA tile copies between global and shared
# memory (tma.async_copy_global_to_shared and async_copy_shared_to_global through 3.7, async_load and async_store
# from 3.8).
thread_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global


@gluon.jit
def sequence(CU_Q, CU_K, b, N_QUERIES, N_KEYS, DIAG, VARLEN: gl.constexpr):
    # (first query row, queries, first key row, keys, diagonal) of sequence b, as tiles.sequence has them for the
    # Triton kernels: a packed batch's from cu_seqlens (diagonal bottom-right), a dense batch's from the arguments.
    if VARLEN:
        q_start = gl.load(CU_Q + b)
        n_q = gl.load(CU_Q + b + 1) - q_start
        k_start = gl.load(CU_K + b)
        n_k = gl.load(CU_K + b + 1) - k_start
        diag = n_k - n_q
    else:
        q_start = 0
        n_q = N_QUERIES
        k_start = 0
        n_k = N_KEYS
        diag = DIAG
    return q_start, n_q, k_start, n_k, diag


@gluon.jit
def tanh(x):
    # The hardware's tanh (one MUFU op, relative error below 2^-10.9), as the Triton kernels' tiles.tanh on a GPU.
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def tile_ranges(first, SPAN: gl.constexpr, n, BELOW, ABOVE, TILE: gl.constexpr):
    # tiles._tile_ranges in Gluon: the TILE-wide tiles of a sequence of n rows that rows first - BELOW .. first +
    # SPAN - 1 + ABOVE reach (row r of the other side reaching r - BELOW .. r + ABOVE), as tile indices lo <= full_lo
    # <= full_hi <= hi, [full_lo, full_hi) complete and reached by every one of the SPAN rows.
    last = first + SPAN - 1
    lo = gl.maximum(first - BELOW, 0) // TILE
    hi = gl.maximum(gl.cdiv(gl.maximum(gl.minimum(last + ABOVE + 1, n), 0), TILE), lo)
    full_lo = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(last - BELOW, 0), TILE), lo), hi)
    full_hi = gl.minimum(gl.maximum(gl.maximum(gl.minimum(first + ABOVE + 1, n), 0) // TILE, full_lo), hi)
    return lo, full_lo, full_hi, hi


@gluon.constexpr_function
def mma_layout(n):
    """The register layout of a (64 * k, n) fp32 wgmma accumulator of one warpgroup (instructions m64nNk16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


def gluon_unsupported(q: torch.Tensor, direction: str) -> str | None:
    """Why the Gluon kernel of ``direction`` ("forward" or "backward") cannot run for (B, H, T, d) queries like
    ``q`` (a packed batch's (1, H, total, d) view), or None where it can: they need CUDA tensors on an sm_90 GPU
    (H100/H200), fp16 or bf16 and a head dim of :data:`HEAD_DIMS`, and run every one of the scores' parameters
    (scale, softcap, window, alignment, packed sequences)."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return f"the Gluon kernels need CUDA tensors on an sm_90 GPU (H100/H200); got device {q.device}"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"the Gluon kernels take {SUPPORTED_DTYPES}; got {q.dtype}"
    if q.shape[-1] not in HEAD_DIMS[direction]:
        return f"the Gluon {direction} takes head dims {HEAD_DIMS[direction]}; got {q.shape[-1]}"
    return None


def gluon_applies(q: torch.Tensor, direction: str) -> bool:
    """The ``auto`` rule of ``direction`` ("forward" or "backward"): whether its Gluon kernel runs for queries like
    ``q`` (:func:`gluon_unsupported`)."""
    return gluon_unsupported(q, direction) is None


def check_gluon(q: torch.Tensor, direction: str) -> None:
    """Raise ValueError naming why, where the Gluon kernel of ``direction`` cannot run for queries like ``q``
    (:func:`gluon_unsupported`)."""
    reason = gluon_unsupported(q, direction)
    if reason is not None:
        raise ValueError(reason)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: Params, direction: str) -> None:
    # The portable kernels' checks (types, shapes, GQA heads, devices), then what these kernels add.
    check_portable_inputs(q, k, v, params.window_right == 0)
    if q.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, heads, seq, d); got shapes {tuple(q.shape)}, {tuple(k.shape)}")
    check_gluon(q, direction)


def tma_ready(x: torch.Tensor) -> torch.Tensor:
    # TMA needs a 16-byte-aligned base, unit stride on d and 16-byte-aligned other strides; copy otherwise.
    aligned = x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])
    return x if aligned and x.stride(-1) == 1 else x.contiguous()


def descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    # (1, 1, rows, d rounded up to a power of two) boxes of a (batch, heads, seq, d) tensor: reads past the end of a
    # head's rows or of d come back as zeros and writes there are dropped, whatever lies next in memory.
    block = [1, 1, block_rows, triton.next_power_of_2(x.shape[-1])]
    return TensorDescriptor.from_tensor(x, block, gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[x.dtype]))
