"""What the Gluon (sm_90) attention kernels of :mod:`~cs336_kernels.ops.flash_attention.gluon_forward` and
:mod:`~cs336_kernels.ops.flash_attention.gluon_backward` share: where they apply, their input checks, TMA
descriptors, the wgmma accumulator layout and the register split between producer and consumers.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cs336_kernels.ops.flash_attention.checks import check_inputs as check_portable_inputs

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128)
# 12 warps (two consumer warpgroups and the producer's warpgroup) share 64 K registers per SM: 168 each at
# launch, then setmaxnreg moves them from the producer (24) to the consumers (240).
MAX_REGISTERS = 168
CONSUMER_REGISTERS = gl.constexpr(240)
PRODUCER_REGISTERS = gl.constexpr(24)
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


@gluon.constexpr_function
def mma_layout(n):
    """The register layout of a (64 * k, n) fp32 wgmma accumulator of one warpgroup (instructions m64nNk16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


def gluon_applies(q: torch.Tensor) -> bool:
    """The ``auto`` rule of both directions: whether the Gluon kernels run for queries like ``q`` (keys and values
    match them): CUDA tensors on an sm_90 GPU (H100/H200), fp16 or bf16, head dim 64 or 128."""
    return (q.is_cuda and q.dtype in SUPPORTED_DTYPES and q.shape[-1] in SUPPORTED_HEAD_DIMS
            and torch.cuda.get_device_capability(q.device)[0] == 9)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> None:
    # The portable kernels' checks (types, shapes, GQA heads, devices), then what these kernels add.
    check_portable_inputs(q, k, v, is_causal)
    if q.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, heads, seq, d); got shapes {tuple(q.shape)}, {tuple(k.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q, k, v must share one dtype among {SUPPORTED_DTYPES}; got {q.dtype}")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim must be one of {SUPPORTED_HEAD_DIMS}, got {q.shape[-1]}")
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        raise ValueError(f"the Gluon kernels need CUDA tensors on an sm_90 GPU (H100/H200); got device {q.device}")


def tma_ready(x: torch.Tensor) -> torch.Tensor:
    # TMA needs a 16-byte-aligned base, unit stride on d and 16-byte-aligned other strides; copy otherwise.
    aligned = x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])
    return x if aligned and x.stride(-1) == 1 else x.contiguous()


def descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    # (1, 1, rows, d) boxes of a (batch, heads, seq, d) tensor: reads past the end of a head's rows come back
    # as zeros and writes there are dropped, whatever lies next in memory.
    block = [1, 1, block_rows, x.shape[-1]]
    return TensorDescriptor.from_tensor(x, block, gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[x.dtype]))
