"""What the Gluon (sm_90) attention kernels of :mod:`~cs336_kernels.ops.flash_attention.gluon_forward` and
:mod:`~cs336_kernels.ops.flash_attention.gluon_backward` share: where they apply, their input checks, TMA
descriptors, the wgmma accumulator layout, the register split between producer and consumers, and the order in
which programs take their tiles (:func:`tile_coords`, :func:`heads_per_chunk`).
"""

from __future__ import annotations

import functools

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


@gluon.jit
def tile_coords(tile, n_rows, n_heads, CHUNK, REVERSE: gl.constexpr):
    """The (head, row) of the ``tile``-th tile of a persistent kernel's queue, with ``n_rows`` tile rows per head:
    heads go in chunks of ``CHUNK`` (a chunk's tensors stay in the L2 cache while its tiles run), and within a
    chunk row by row, every head of the chunk at each row; rows run from the last when ``REVERSE``. With the
    heaviest causal rows first, the last tiles claimed are light ones from every head of the last chunk."""
    first = tile // (CHUNK * n_rows) * CHUNK
    heads = gl.minimum(CHUNK, n_heads - first)
    local = tile - first * n_rows
    row = local // heads
    if REVERSE:
        row = n_rows - 1 - row
    return first + local % heads, row


@gluon.jit
def claim_tile(counter):
    """The next unclaimed tile of a persistent kernel's queue (``counter`` counts those claimed; it starts at 0),
    for the calling warp: lane 0 adds one and the warp shares what it read."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 lane, t; mov.u32 lane, %laneid; setp.eq.u32 p, lane, 0; mov.b32 t, 0; "
        "@p atom.global.add.u32 t, [$1], 1; shfl.sync.idx.b32 $0, t, 0, 31, -1; }",
        "=r,l", [counter], dtype=gl.int32, is_pure=False, pack=1)


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def _device_properties(device: torch.device):
    return _properties(device.index if device.index is not None else torch.cuda.current_device())


def sm_count(device: torch.device) -> int:
    """How many SMs the GPU ``device`` has: the number of programs of a persistent kernel."""
    return _device_properties(device).multi_processor_count


def heads_per_chunk(head_bytes: int, device: torch.device) -> int:
    """How many heads :func:`tile_coords` groups, given the bytes that the programs of one head stream from
    memory: as many as fill half of ``device``'s L2 cache, at least one."""
    return max(1, _device_properties(device).L2_cache_size // 2 // head_bytes)
