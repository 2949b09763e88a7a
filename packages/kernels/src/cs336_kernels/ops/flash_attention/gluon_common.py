"""What the Gluon (sm_90) attention kernels of :mod:`~cs336_kernels.ops.flash_attention.gluon_forward` and
:mod:`~cs336_kernels.ops.flash_attention.gluon_backward` share: where they apply, their input checks, TMA
descriptors, the wgmma accumulator layout and the register split between producer and consumers.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cs336_kernels.ops.flash_attention.checks import check_inputs as check_portable_inputs
from cs336_kernels.ops.flash_attention.params import Params

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128)
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


@gluon.constexpr_function
def mma_layout(n):
    """The register layout of a (64 * k, n) fp32 wgmma accumulator of one warpgroup (instructions m64nNk16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


def gluon_unsupported(q: torch.Tensor, k: torch.Tensor | None = None, params: Params | None = None) -> str | None:
    """Why the Gluon kernels cannot run for (B, H, T, d) queries like ``q``, keys like ``k`` (default: like ``q``)
    and the scores' parameters ``params`` (default: plain), or None where they can: they need CUDA tensors on an
    sm_90 GPU (H100/H200), fp16 or bf16, head dim 64 or 128, and run any softmax scale, full attention or the causal
    mask with its diagonal through key i for query i (seq_q == seq_k, or the course's top-left alignment)."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return f"the Gluon kernels need CUDA tensors on an sm_90 GPU (H100/H200); got device {q.device}"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"the Gluon kernels take {SUPPORTED_DTYPES}; got {q.dtype}"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"the Gluon kernels take head dims {SUPPORTED_HEAD_DIMS}; got {q.shape[-1]}"
    if params is None:
        return None
    if params.varlen or params.softcap or params.window_left >= 0 or params.window_right > 0:
        return "the Gluon kernels run neither packed sequences, nor windows, nor softcaps; the Triton ones do"
    if params.window_right == 0 and params.bottom_right and k is not None and k.shape[-2] != q.shape[-2]:
        return "the Gluon kernels align the causal diagonal top-left; seq_q != seq_k bottom-right runs on Triton"
    return None


def gluon_applies(q: torch.Tensor, k: torch.Tensor | None = None, params: Params | None = None) -> bool:
    """The ``auto`` rule of both directions: whether the Gluon kernels run here (:func:`gluon_unsupported`)."""
    return gluon_unsupported(q, k, params) is None


def check_gluon(q: torch.Tensor, k: torch.Tensor, params: Params) -> None:
    """Raise ValueError naming why, where the Gluon kernels cannot run (:func:`gluon_unsupported`)."""
    reason = gluon_unsupported(q, k, params)
    if reason is not None:
        raise ValueError(reason)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: Params) -> None:
    # The portable kernels' checks (types, shapes, GQA heads, devices), then what these kernels add.
    check_portable_inputs(q, k, v, params.window_right == 0)
    if q.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, heads, seq, d); got shapes {tuple(q.shape)}, {tuple(k.shape)}")
    check_gluon(q, k, params)


def tma_ready(x: torch.Tensor) -> torch.Tensor:
    # TMA needs a 16-byte-aligned base, unit stride on d and 16-byte-aligned other strides; copy otherwise.
    aligned = x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])
    return x if aligned and x.stride(-1) == 1 else x.contiguous()


def descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    # (1, 1, rows, d) boxes of a (batch, heads, seq, d) tensor: reads past the end of a head's rows come back
    # as zeros and writes there are dropped, whatever lies next in memory.
    block = [1, 1, block_rows, x.shape[-1]]
    return TensorDescriptor.from_tensor(x, block, gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[x.dtype]))
