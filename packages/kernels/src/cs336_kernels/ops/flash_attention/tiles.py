"""What the forward and backward FlashAttention-2 kernels share: tile loads and tile ranges in Triton,
and the compile-time constants and TMA scratch memory of their launches.

A main loop re-reads two (rows, d) tiles per step, either through pointer tiles (:func:`tile_ptr`, with bounds
checks only where a tile can be partial) or through TMA tensor descriptors. A program finds its sequence's rows
(:func:`sequence`: a dense batch's, or a packed one's from cu_seqlens); the forward and dQ kernels walk the key
tiles of one query tile (:func:`key_tile_ranges`), the dK/dV kernel the query tiles of one key tile
(:func:`query_tile_ranges`), each in three ranges: the tiles of the window's two edges masked by
:func:`visible`, the tiles between them unmasked, the tiles outside it never loaded.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cs336_kernels.interpreter import INTERPRET
from cs336_kernels.ops.flash_attention.params import Params

_INTERPRET = tl.constexpr(INTERPRET)


@triton.jit
def tile_ptr(BASE, N_ROWS, stride_t, stride_d, start, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
             BLOCK_D: tl.constexpr):
    # The (BLOCK_ROWS, BLOCK_D) tile at row `start` of one head's (N_ROWS, HEAD_DIM) tensor as a tuple: its
    # pointers, row indices, row count, row stride and which of its columns exist, what load_tile, store_tile and
    # advance_tile need. Plain pointers, not tl.make_block_ptr, which Triton 3.9 removed; offsets in 64 bits, as a
    # block pointer's.
    rows = start + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    ptrs = BASE + rows.to(tl.int64)[:, None] * stride_t + cols[None, :] * stride_d
    return ptrs, rows, N_ROWS, stride_t.to(tl.int64), cols < HEAD_DIM


@triton.jit
def advance_tile(tile, ROWS: tl.constexpr):
    # The tile ROWS rows further down.
    ptrs, rows, n_rows, stride_t, cols_ok = tile
    return ptrs + ROWS * stride_t, rows + ROWS, n_rows, stride_t, cols_ok


@triton.jit
def load_tile(tile, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    # Bounds checks cost address arithmetic in the hot loop, so only partial tiles pay for them; what lies outside
    # the tensor reads as zero.
    ptrs, rows, n_rows, stride_t, cols_ok = tile
    if CHECK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=(rows < n_rows)[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows < n_rows)[:, None] & cols_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs) if EVEN_D else tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    return x


@triton.jit
def store_tile(tile, x):
    # Writes the rows and columns of x that lie inside the tensor.
    ptrs, rows, n_rows, stride_t, cols_ok = tile
    tl.store(ptrs, x, mask=(rows < n_rows)[:, None] & cols_ok[None, :])


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
    # The two tiles a main loop reads at row `start`: by TMA (no bounds checks needed), or by pointer tiles.
    if USE_TMA:
        a = A_DESC.load([start, 0])
        b = B_DESC.load([start, 0])
    else:
        a = load_tile(A_BLOCK, CHECK_ROWS, EVEN_D)
        b = load_tile(B_BLOCK, CHECK_ROWS, EVEN_D)
    return a, b


@triton.jit
def sequence(CU_Q, CU_K, b, N_QUERIES, N_KEYS, DIAG, VARLEN: tl.constexpr):
    # (first query row, queries, first key row, keys, diagonal) of sequence b. Packed sequences read their bounds
    # from cu_seqlens and align the diagonal bottom-right (FlashAttention-2's rule); a dense batch has all of them
    # as arguments. Query i of the sequence sits on key i + diagonal.
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        n_q = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        n_k = tl.load(CU_K + b + 1) - k_start
        diag = n_k - n_q
    else:
        q_start = 0
        n_q = N_QUERIES
        k_start = 0
        n_k = N_KEYS
        diag = DIAG
    return q_start, n_q, k_start, n_k, diag


@triton.jit
def _tile_ranges(first, SPAN: tl.constexpr, n, BELOW, ABOVE, TILE: tl.constexpr):
    # The TILE-wide tiles of a sequence of n rows that rows first-BELOW .. first+SPAN-1+ABOVE reach, where row r of
    # the other side reaches rows r - BELOW .. r + ABOVE: tile starts lo <= full_lo <= full_hi <= hi, with the
    # tiles in [full_lo, full_hi) complete and reached by every one of the SPAN rows.
    last = first + SPAN - 1
    lo = (tl.maximum(first - BELOW, 0) // TILE) * TILE
    hi = tl.maximum((tl.maximum(tl.minimum(last + ABOVE + 1, n), 0) + TILE - 1) // TILE * TILE, lo)
    full_lo = (tl.maximum(last - BELOW, 0) + TILE - 1) // TILE * TILE
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(first + ABOVE + 1, n), 0) // TILE * TILE
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def key_tile_ranges(q0, n_k, diag, WIN_L, WIN_R, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The key tiles that the query tile starting at q0 visits, as tile starts lo <= full_lo <= full_hi <= hi: tiles
    # in [full_lo, full_hi) are complete and every row of the query tile sees every key of them (no mask); those in
    # [lo, full_lo) and [full_hi, hi) hold some key that some row must not see (masked); the others are skipped.
    # Row i sees keys i + diag - WIN_L .. i + diag + WIN_R (unbounded sides are passed as lengths too large to bind).
    return _tile_ranges(q0 + diag, BLOCK_M, n_k, WIN_L, WIN_R, BLOCK_N)


@triton.jit
def query_tile_ranges(k0, n_q, diag, WIN_L, WIN_R, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The query tiles that see a key of the tile starting at k0, as in key_tile_ranges: [full_lo, full_hi) are
    # complete tiles whose every row sees every key of the tile, the rest of [lo, hi) is masked. Key j is seen by
    # rows j - diag - WIN_R .. j - diag + WIN_L.
    return _tile_ranges(k0 - diag, BLOCK_N, n_q, WIN_R, WIN_L, BLOCK_M)


@triton.jit
def visible(offs_m, offs_n, n_k, diag, WIN_L, WIN_R, KEYS_FIRST: tl.constexpr, CHECK_KEYS: tl.constexpr,
            WINDOW: tl.constexpr):
    # (queries, keys), or (keys, queries) with KEYS_FIRST, True where query offs_m may see key offs_n: the key
    # inside the query's window around its diagonal (its left side checked only for a WINDOW) and, with CHECK_KEYS,
    # before the sequence's end (a key past it reads as zeros: the forward must not count it, the backward's
    # products drop it by themselves; a query past the end has L = +inf, so P = 0 there). Each side is one
    # comparison a score against a bound per row, not a (rows, columns) matrix of offsets.
    if KEYS_FIRST:
        keep = offs_m[None, :] >= (offs_n - diag - WIN_R)[:, None]
        if WINDOW:
            keep = keep & (offs_m[None, :] <= (offs_n - diag + WIN_L)[:, None])
    else:
        end = offs_m + diag + WIN_R + 1
        if CHECK_KEYS:
            end = tl.minimum(end, n_k)
        keep = offs_n[None, :] < end[:, None]
        if WINDOW:
            keep = keep & (offs_n[None, :] >= (offs_m + diag - WIN_L)[:, None])
    return keep


@triton.jit
def tanh(x):
    # On a GPU the hardware's tanh (one MUFU op, relative error below 2^-10.9), as the Gluon kernels use it, so
    # that a forward and a backward of either kind agree; in the interpreter (no inline PTX) from one exp2, exact
    # at both ends.
    if _INTERPRET:
        return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


def kernel_constants(q: torch.Tensor, params: Params) -> dict:
    """The constexprs every attention kernel takes, from (B, H, T, d) ``q`` and the call's :class:`Params`."""
    head_dim = q.shape[-1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    return {
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "EVEN_D": head_dim == block_d,
        "SOFTCAP": params.softcap > 0,
        "WINDOW": params.window_left >= 0,
        "VARLEN": params.varlen,
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


@dataclass(frozen=True)
class LaunchGeometry:
    """Where a launch's programs go: ``n_seqs`` sequences of at most ``rows_q`` queries and ``rows_k`` keys."""

    n_seqs: int
    rows_q: int
    rows_k: int
    varlen: bool

    def strides(self, t: torch.Tensor) -> tuple[int, ...]:
        """(batch, head, row, d) strides of a (B, H, T, d) tensor; a packed batch's (1, H, total, d) view gets a 0
        batch stride, since its sequences are told apart by their first rows, not by the batch dim."""
        return (0, *t.stride()[1:]) if self.varlen else t.stride()


def launch_geometry(params: Params, q: torch.Tensor, k: torch.Tensor) -> LaunchGeometry:
    """The :class:`LaunchGeometry` of (B, H, T, d) ``q`` and ``k`` (a packed batch's views) under ``params``."""
    if params.varlen:
        return LaunchGeometry(params.cu_seqlens_q.numel() - 1, params.max_seqlen_q, params.max_seqlen_k, True)
    return LaunchGeometry(q.shape[0], q.shape[2], k.shape[2], False)


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
