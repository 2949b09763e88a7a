"""What the forward and backward FlashAttention-2 kernels share: tile loads and tile ranges in Triton,
and the compile-time constants and TMA scratch memory of their launches.

A main loop re-reads two (rows, d) tiles per step, either through block pointers (with bounds checks only
where a tile can be partial) or through TMA tensor descriptors. The forward kernel and the dQ kernel walk
the key tiles of one query tile in the same two ranges (:func:`key_tile_ranges`) and mask the second one
alike (:func:`key_mask`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def tile_ptr(BASE, N_ROWS, stride_t, stride_d, start, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
             BLOCK_D: tl.constexpr):
    # Block pointer to the (BLOCK_ROWS, BLOCK_D) tile at row `start` of one head's (N_ROWS, HEAD_DIM) tensor.
    return tl.make_block_ptr(
        BASE, shape=(N_ROWS, HEAD_DIM), strides=(stride_t, stride_d),
        offsets=(start, 0), block_shape=(BLOCK_ROWS, BLOCK_D), order=(1, 0),
    )


@triton.jit
def load_tile(block_ptr, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    # Bounds checks cost address arithmetic in the hot loop, so only partial tiles pay for them.
    if CHECK_ROWS:
        if EVEN_D:
            x = tl.load(block_ptr, boundary_check=(0,), padding_option="zero")
        else:
            x = tl.load(block_ptr, boundary_check=(0, 1), padding_option="zero")
    else:
        x = tl.load(block_ptr) if EVEN_D else tl.load(block_ptr, boundary_check=(1,), padding_option="zero")
    return x


@triton.jit
def tma_descriptors(
    A_BASE, B_BASE, stride_at, stride_bt, N_ROWS, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Descriptors for the two (rows, d) tensors of one head that a main loop re-reads. TMA copies whole tiles
    # into shared memory without per-thread addresses, which frees registers, and fills rows past N_ROWS and
    # columns past HEAD_DIM with zeros, so no tile needs a bounds check.
    a = tl.make_tensor_descriptor(
        A_BASE, shape=[N_ROWS, HEAD_DIM], strides=[stride_at, 1], block_shape=[BLOCK_ROWS, BLOCK_D]
    )
    b = tl.make_tensor_descriptor(
        B_BASE, shape=[N_ROWS, HEAD_DIM], strides=[stride_bt, 1], block_shape=[BLOCK_ROWS, BLOCK_D]
    )
    return a, b


@triton.jit
def load_tiles(A_BLOCK, B_BLOCK, A_DESC, B_DESC, start, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr,
               USE_TMA: tl.constexpr):
    # The two tiles a main loop reads at row `start`: by TMA (no bounds checks needed), or by block pointers.
    if USE_TMA:
        a = A_DESC.load([start, 0])
        b = B_DESC.load([start, 0])
    else:
        a = load_tile(A_BLOCK, CHECK_ROWS, EVEN_D)
        b = load_tile(B_BLOCK, CHECK_ROWS, EVEN_D)
    return a, b


@triton.jit
def key_tile_ranges(q0, N_KEYS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    # The key tiles that the query tile starting at q0 visits. Tiles in [0, full_end) are complete and (if
    # causal) wholly below the diagonal: no mask. Tiles in [full_end, hi) straddle the diagonal or the end
    # of the keys: masked. Tiles past hi are skipped.
    k_full = (N_KEYS // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        full_end = tl.minimum(q0, k_full)
        hi = tl.minimum(q0 + BLOCK_M, N_KEYS)
    else:
        full_end = k_full
        hi = N_KEYS
    return full_end, hi


@triton.jit
def key_mask(offs_m, start, N_KEYS, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    # (queries, BLOCK_N) True where query offs_m may see key start + j: never past the last key and, if
    # causal, only at or before the query.
    offs_n = start + tl.arange(0, BLOCK_N)
    keep = offs_n[None, :] < N_KEYS
    if IS_CAUSAL:
        keep = keep & (offs_m[:, None] >= offs_n[None, :])
    return keep


def kernel_constants(q: torch.Tensor, is_causal: bool) -> dict:
    """The constexprs every attention kernel takes, from (B, H, T, d) ``q``."""
    head_dim = q.shape[-1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    return {
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "EVEN_D": head_dim == block_d,
        "IS_CAUSAL": is_causal,
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


def _tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # Global memory in which each program of a TMA config writes its tensor descriptors.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def with_tma_scratch(launch: Callable[[], None]) -> None:
    """Run ``launch`` with Triton's allocator set for TMA descriptors, in a copy of the caller's context so
    that an allocator the caller installed stays in place."""
    def run() -> None:
        triton.set_allocator(_tma_scratch)
        launch()

    contextvars.copy_context().run(run)
