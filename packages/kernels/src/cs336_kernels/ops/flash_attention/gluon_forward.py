"""FlashAttention forward for Hopper (sm_90) in Gluon, warp-specialised as in FlashAttention-3 (Shah et al., 2024).

The kernel is persistent: one program per SM takes query tiles of ``2 * BLOCK_M`` rows of one (sequence, query head)
from a queue (an atomic counter; head by head, under a causal mask the longest tiles of each head first:
:func:`_tile_code`) until none is left, and runs three partitions:

- a one-warp producer that claims the tiles, tells the consumers each one through shared memory, loads its two Q
  tiles and streams its K and V tiles by TMA into a ``STAGES``-deep shared-memory ring, each slot guarded by
  "ready" mbarriers (the TMA completes them) and "empty" mbarriers (both consumers release them). The ring runs
  on from one query tile to the next, and the next Q is loaded as soon as both consumers have issued their last
  ``Q K^T``, so a tile's last ``P V`` and epilogue overlap the next tile's loads;
- two consumer warpgroups, one per ``BLOCK_M``-row Q tile, that run ``S = Q K^T`` and ``O += P V`` on the
  tensor cores with ``warpgroup_mma`` (wgmma) and the online softmax in fp32 with exp2 on the CUDA cores.
  A consumer issues the next tile's ``Q K^T`` and the current tile's ``P V`` back to back and computes the
  next softmax while ``P V`` runs (FA3's intra-warpgroup overlap); the two consumers also overlap each
  other, since the warp schedulers interleave them. O leaves through a staging buffer of its own by a TMA store
  that completes while the next tile runs (at d = 256, where shared memory has no room for it, and for a packed
  batch, by a masked store from registers).

Conventions are those of :mod:`cs336_kernels.ops.flash_attention.params`: (batch, heads, seq, d) tensors (a packed
batch as the (1, heads, total, d) view of its (total, heads, d) tensor, its sequences read from cu_seqlens),
grouped-query attention (query head ``h`` reads key/value head ``h // (Hq // Hkv)``), the window of keys each query
sees around its diagonal (causal, sliding; aligned bottom-right or, for the course's functions, top-left), the
softmax scale and softcap, and the logsumexp ``L`` of the scores in natural-log units, fp32, ``-inf`` for a query that
sees no key. Key tiles outside every row's window are never loaded; only tiles that straddle a window's edge or
the end of the keys are masked. The tensors are addressed by 4-D TMA descriptors, so the hardware zero-fills reads
past the end of a head and clips the O store there: any sequence length works without masked loads (a packed
batch's rows past a sequence's end are its neighbour's, masked as keys and stored around as outputs). Tiles are
as wide as the head dim rounded up to a power of two: at d = 96 the descriptors' 128-column boxes read zeros past
column 96.

The kernels need an sm_90 GPU; they do not run in the Triton interpreter. Tests:
``pytest -m gpu packages/kernels/tests/test_gluon_attention.py`` on an H100/H200. What each variant measured is in
``writeup/results/attention_notes.md``.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from cs336_kernels.ops._common import output_like
from cs336_kernels.ops.flash_attention.gluon_common import (
    CONSUMER_REGISTERS,
    MAX_REGISTERS,
    PRODUCER_REGISTERS,
    check_inputs,
    descriptor,
    mma_layout,
    sequence,
    tanh,
    thread_barrier,
    tile_ranges,
    tma_load,
    tma_ready,
    tma_store,
)
from cs336_kernels.ops.flash_attention.params import Params

# Per head dim: (BLOCK_M query rows per consumer warpgroup, BLOCK_N keys per tile, STAGES of the K/V ring).
# One wgmma warpgroup covers 64 rows; with the Q and O staging buffers the ring fills most of the 227 KiB of shared
# memory per block: d = 128: 2 x 16 KiB Q + 2 x 16 KiB O + 2 x (32 + 32) KiB K/V; d = 64: 2 x 8 KiB Q + 2 x 8 KiB O
# + 3 x (16 + 16) KiB K/V; d = 96 runs d = 128's tiles. At d = 256 a consumer's O accumulator takes 128 fp32
# registers a thread, which leaves room for 64-key tiles only (128-key ones spill); 2 x 32 KiB Q + 2 x (32 + 32)
# KiB K/V leave no room for O's staging buffers, so O is stored from registers (:func:`stages_o`).
CONFIGS = {64: (64, 128, 3), 96: (64, 128, 2), 128: (64, 128, 2), 256: (64, 64, 2)}


def stages_o(head_dim: int, varlen: bool) -> bool:
    """Whether O leaves through shared memory and a TMA store (which clips rows past the end of a head), rather than
    by a masked store from registers: not at d = 256 (no room) nor for a packed batch, whose rows past a sequence's
    end belong to the next one."""
    return head_dim <= 128 and not varlen


@gluon.jit
def _claim_tile(counter):
    # The next unclaimed tile of the queue (counter counts those claimed), for the calling warp: lane 0 adds one
    # and the warp shares what it read.
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 lane, t; mov.u32 lane, %laneid; setp.eq.u32 p, lane, 0; mov.b32 t, 0; "
        "@p atom.global.add.u32 t, [$1], 1; shfl.sync.idx.b32 $0, t, 0, 31, -1; }",
        "=r,l", [counter], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _tile_code(t, n_m, H_Q, TILE_OFFSETS, N_SEQS, REVERSE: gl.constexpr, VARLEN: gl.constexpr):
    # The code (b * H_Q + h) * n_m + m of the t-th query tile of the queue (tile m of query head h of sequence b),
    # which the consumers decode with two divisions. A (batch, query head)'s tiles are consecutive, so that they
    # share its K and V through the L2 cache; under a causal mask the tiles near the end have the most key tiles and
    # go first, so that the last tiles claimed are light ones. A packed batch's queue holds only its sequences' own
    # tiles: TILE_OFFSETS[b] counts those of the sequences before b (times H_Q), found by bisection.
    if VARLEN:
        lo = 0
        hi = N_SEQS
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if gl.load(TILE_OFFSETS + mid) <= t:
                lo = mid
            else:
                hi = mid
        first = gl.load(TILE_OFFSETS + lo)
        per_head = (gl.load(TILE_OFFSETS + lo + 1) - first) // H_Q
        bh = lo * H_Q + (t - first) // per_head
        m = (t - first) % per_head
    else:
        per_head = n_m
        bh = t // n_m
        m = t % n_m
    if REVERSE:
        m = per_head - 1 - m
    return bh * n_m + m


@gluon.jit
def _producer(
    q_desc, k_desc, v_desc, bufs, tile_buf, COUNTER, CU_Q, CU_K, TILE_OFFSETS, n_m, BH, H_Q, GROUP, N_QUERIES, N_KEYS,
    DIAG, WIN_L, WIN_R, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, REVERSE: gl.constexpr,
    VARLEN: gl.constexpr,
):
    q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = bufs
    id_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    n_seqs = BH // H_Q
    n_total = gl.load(TILE_OFFSETS + n_seqs) if VARLEN else n_m * BH
    tile = gl.program_id(0)
    it = 0  # ring position of the tile's first key tile
    count = 0  # query tiles handed to the consumers so far
    while tile < n_total:
        code = _tile_code(tile, n_m, H_Q, TILE_OFFSETS, n_seqs, REVERSE, VARLEN)
        # Both consumers are done with the Q buffers and have read the last tile's code. A fresh mbarrier counts
        # as having completed the phase before phase 0, so the first wait (and the first pass through the ring)
        # does not block.
        mbarrier.wait(q_empty.index(0), (count & 1) ^ 1)
        tile_buf.store(gl.full([1], code, gl.int32, layout=id_layout))
        bh = code // n_m
        b = bh // H_Q
        h = bh % H_Q
        h_kv = h // GROUP
        q_start, n_q, k_start, n_k, diag = sequence(CU_Q, CU_K, b, N_QUERIES, N_KEYS, DIAG, VARLEN)
        q0 = (code % n_m) * (2 * BLOCK_M)
        j0, _, _, j1 = tile_ranges(q0 + diag, 2 * BLOCK_M, n_k, WIN_L, WIN_R, BLOCK_N)
        n_tiles = gl.maximum(j1 - j0, 1)  # a tile whose rows see no key still runs one (masked) key tile
        # A packed batch's tensors are (1, heads, total, d) views: the sequence is told by its first row.
        b_row = 0 if VARLEN else b
        for c in gl.static_range(2):
            mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
            tma_load(q_desc, [b_row, h, q_start + q0 + c * BLOCK_M, 0], q_ready.index(c),
                                            q_bufs.index(c))
        for j in range(n_tiles):
            stage = (it + j) % STAGES
            phase = (((it + j) // STAGES) & 1) ^ 1
            row = k_start + (j0 + j) * BLOCK_N
            mbarrier.wait(k_empty.index(stage), phase)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma_load(k_desc, [b_row, h_kv, row, 0], k_ready.index(stage), k_bufs.index(stage))
            mbarrier.wait(v_empty.index(stage), phase)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma_load(v_desc, [b_row, h_kv, row, 0], v_ready.index(stage), v_bufs.index(stage))
        it += n_tiles
        count += 1
        tile = _claim_tile(COUNTER) + gl.num_programs(0)
    # No tile left: a code past the end tells the consumers to stop.
    mbarrier.wait(q_empty.index(0), (count & 1) ^ 1)
    tile_buf.store(gl.full([1], n_m * BH, gl.int32, layout=id_layout))
    for c in gl.static_range(2):
        mbarrier.arrive(q_ready.index(c))


@gluon.jit
def _scores(s, kt, masked, row0, diag, n_k, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out, m_i,
            s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SOFTCAP: gl.constexpr,
            WINDOW: gl.constexpr):
    # Scores stay raw (unscaled) so that the row max needs no multiply and exp2(s * scale - m) is one FMA;
    # the scale (softmax_scale * log2(e)) is positive, so max and scaling commute. A softcap leaves them in log2
    # units (qk_scale is 1 then). Only tiles outside [full_lo, full_hi) hold keys some row must not see.
    if SOFTCAP:
        s = tanh(s * softcap_in) * softcap_out
    if masked:
        offs_n = kt * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        offs_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        # Row i sees keys below min(i + diag + WIN_R + 1, n_k): one comparison a score (a second one only for a
        # bounded left side), each key index used once, so ptxas does not keep the tile's key indices in registers
        # for a second pass.
        keep = offs_n[None, :] < gl.minimum(offs_m + diag + WIN_R + 1, n_k)[:, None]
        if WINDOW:
            keep = keep & (offs_n[None, :] >= (offs_m + diag - WIN_L)[:, None])
        s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        # A row that has seen no key yet (a window's first tiles, more queries than keys) exponentiates against 0.
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        m_use = m_new
    p = gl.exp2(s * qk_scale - m_use[:, None])
    return p, m_new, m_use


@gluon.jit
def _consumer(
    args, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_D: gl.constexpr, STAGES: gl.constexpr, STAGE_O: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr,
    VARLEN: gl.constexpr,
):
    (o_desc, O, L, CU_Q, CU_K, bufs, o_bufs, tile_buf, n_m, BH, H_Q, N_QUERIES, N_KEYS, DIAG, WIN_L, WIN_R,
     stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, qk_scale, softcap_in, softcap_out) = args
    q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = bufs
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(BLOCK_D)
    # P feeds the P V wgmma from registers: for 16-bit types this layout holds the same elements per thread as
    # the S accumulator, so the conversion moves no data.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    id_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])

    q_tile = q_bufs.index(CONSUMER)
    q_smem = q_tile.reshape([BLOCK_M, BLOCK_D])
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    n_codes = n_m * BH
    it = 0  # ring position of the tile's first key tile
    count = 0  # query tiles done
    mbarrier.wait(q_ready.index(CONSUMER), 0)
    code = gl.max(tile_buf.load(id_layout), axis=0)
    while code < n_codes:
        b = code // n_m // H_Q
        q_start, n_q, k_start, n_k, diag = sequence(CU_Q, CU_K, b, N_QUERIES, N_KEYS, DIAG, VARLEN)
        q0 = (code % n_m) * (2 * BLOCK_M)
        j0, full_lo, full_hi, j1 = tile_ranges(q0 + diag, 2 * BLOCK_M, n_k, WIN_L, WIN_R, BLOCK_N)
        n_tiles = gl.maximum(j1 - j0, 1)
        row0 = q0 + CONSUMER * BLOCK_M
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, layout=o_layout)

        # Key tile 0: scores and probabilities only; its P V is issued together with tile 1's Q K^T.
        stage = it % STAGES
        mbarrier.wait(k_ready.index(stage), (it // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(stage).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(stage))
        p, m_i, m_use = _scores(s, j0, (j0 < full_lo) | (j0 >= full_hi), row0, diag, n_k, WIN_L, WIN_R, qk_scale,
                                softcap_in, softcap_out, m_i, s_layout, BLOCK_M, BLOCK_N, SOFTCAP, WINDOW)
        l_i = gl.sum(p, axis=1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_tiles):
            stage = (it + j) % STAGES
            prev = (it + j - 1) % STAGES
            mbarrier.wait(k_ready.index(stage), ((it + j) // STAGES) & 1)
            s = warpgroup_mma(q_smem, k_bufs.index(stage).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((it + j - 1) // STAGES) & 1)
            acc = warpgroup_mma(p16, v_bufs.index(prev).reshape([BLOCK_N, BLOCK_D]), acc, is_async=True)
            # wgmma groups retire in order: one outstanding group means Q K^T is done and P V may still run.
            s = warpgroup_mma_wait(1, deps=(s,))
            mbarrier.arrive(k_empty.index(stage))
            kt = j0 + j
            p, m_new, m_use = _scores(s, kt, (kt < full_lo) | (kt >= full_hi), row0, diag, n_k, WIN_L, WIN_R,
                                      qk_scale, softcap_in, softcap_out, m_i, s_layout, BLOCK_M, BLOCK_N, SOFTCAP,
                                      WINDOW)
            alpha = gl.exp2(m_i - m_use)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
            mbarrier.arrive(v_empty.index(prev))
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p16 = gl.convert_layout(p.to(dtype), p_layout)
            m_i = m_new
        # Every Q K^T of this tile is done: the producer may load the next tile's Q while this one finishes.
        mbarrier.arrive(q_empty.index(0))
        last = (it + n_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((it + n_tiles - 1) // STAGES) & 1)
        acc = warpgroup_mma(p16, v_bufs.index(last).reshape([BLOCK_N, BLOCK_D]), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last))

        # Epilogue: a row that saw no key gets 0 and L = -inf. O through this consumer's staging buffer once the
        # previous tile's store has read it, then one TMA store, which clips rows past the end of the head (it
        # completes while the next tile runs); where O is not staged (stages_o) it goes by a masked store from
        # registers. L by a masked store.
        seen = l_i > 0.0
        l_safe = gl.where(seen, l_i, 1.0)
        acc = acc / gl.convert_layout(l_safe, row_o)[:, None]
        # The tile's coordinates again: cheaper than keeping them in registers through the loop.
        bh = code // n_m
        b = bh // H_Q
        h = bh % H_Q
        row0 = (code % n_m) * (2 * BLOCK_M) + CONSUMER * BLOCK_M
        offs_m = row0 + gl.arange(0, BLOCK_M, layout=row_s)
        if VARLEN:
            q_start = gl.load(CU_Q + b)
        if STAGE_O:
            o_tile = o_bufs.index(CONSUMER)
            tma.store_wait(0)
            thread_barrier()
            o_tile.reshape([BLOCK_M, BLOCK_D]).store(acc.to(dtype))
            fence_async_shared()
            tma_store(o_desc, [b, h, row0, 0], o_tile)
        else:
            rows = row0 + gl.arange(0, BLOCK_M, layout=row_o)
            cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
            out = O + h.to(gl.int64) * stride_oh + (q_start + rows).to(gl.int64)[:, None] * stride_ot + cols[None, :]
            if not VARLEN:  # a packed batch is one (1, heads, total, d) view
                out += b.to(gl.int64) * stride_ob
            if HEAD_DIM < BLOCK_D:  # one comparison an element: a row past the end keeps no column
                keep = cols[None, :] < gl.where(rows < n_q, HEAD_DIM, 0)[:, None]
            else:
                keep = (rows < n_q)[:, None]
            gl.store(out, acc.to(dtype), mask=keep)
        lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # natural-log units
        gl.store(L + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + q_start + offs_m, lse,
                 mask=offs_m < n_q)
        it += n_tiles
        count += 1
        mbarrier.wait(q_ready.index(CONSUMER), count & 1)
        code = gl.max(tile_buf.load(id_layout), axis=0)
    tma.store_wait(0)


# Lengths and head counts only enter comparisons and offsets: one build serves them all.
@gluon.jit(do_not_specialize=["n_m", "BH", "H_Q", "GROUP", "N_QUERIES", "N_KEYS", "DIAG", "WIN_L", "WIN_R",
                              "stride_ob", "stride_ot", "stride_oh", "stride_lb", "stride_lh"])
def _attn_fwd_kernel(
    q_desc, k_desc, v_desc, o_desc, O, L, COUNTER, CU_Q, CU_K, TILE_OFFSETS,
    n_m, BH, H_Q, GROUP, N_QUERIES, N_KEYS, DIAG, WIN_L, WIN_R, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
    qk_scale, softcap_in, softcap_out,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    STAGE_O: gl.constexpr, REVERSE: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr,
    VARLEN: gl.constexpr,
):
    # Persistent: one program per SM takes query tiles of 2 * BLOCK_M rows (n_m per (sequence, query head), BH
    # heads) in the order of _tile_code until none is left, so that one tile's epilogue overlaps the next one's loads.
    dtype: gl.constexpr = q_desc.dtype
    BLOCK_D: gl.constexpr = q_desc.block_type.shape[3]  # HEAD_DIM rounded up to a power of two
    q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    # Without staging O leaves from registers: the Q buffers stand in for the O buffers, never touched.
    o_bufs = gl.allocate_shared_memory(dtype, [2] + o_desc.block_type.shape, o_desc.layout) if STAGE_O else q_bufs
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    tile_buf = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_ready.index(c), count=1)
    # Both consumers release the Q buffers (and the tile's code) once per tile.
    mbarrier.init(q_empty.index(0), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # Both consumers read every K and V tile; each releases it once.
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)

    bufs = (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty)
    consumer_args = (o_desc, O, L, CU_Q, CU_K, bufs, o_bufs, tile_buf, n_m, BH, H_Q, N_QUERIES, N_KEYS, DIAG, WIN_L,
                     WIN_R, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, qk_scale, softcap_in, softcap_out)
    gl.warp_specialize(
        [
            (_consumer, (consumer_args, 0, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, STAGES, STAGE_O, SOFTCAP, WINDOW,
                         VARLEN)),
            (_consumer, (consumer_args, 1, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, STAGES, STAGE_O, SOFTCAP, WINDOW,
                         VARLEN)),
            (_producer, (q_desc, k_desc, v_desc, bufs, tile_buf, COUNTER, CU_Q, CU_K, TILE_OFFSETS, n_m, BH, H_Q,
                         GROUP, N_QUERIES, N_KEYS, DIAG, WIN_L, WIN_R, BLOCK_M, BLOCK_N, STAGES, REVERSE, VARLEN)),
        ],
        [4, 1],
        [CONSUMER_REGISTERS, PRODUCER_REGISTERS],
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def forward_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, counter: torch.Tensor,
    params: Params, tile_offsets: torch.Tensor | None = None,
) -> tuple[tuple, dict]:
    """The forward kernel's arguments and constexprs for these (B, H, T, d) tensors (a packed batch's (1, H, total,
    d) views, with ``tile_offsets`` from :func:`tile_offsets`), for the launcher and offline builds; ``counter`` is
    the zeroed int32 that counts the claimed query tiles."""
    batch, heads_q, n_queries, head_dim = q.shape
    heads_kv, n_keys = k.shape[1], k.shape[2]
    block_m, block_n, stages = CONFIGS[head_dim]
    scalars = params.kernel_args(n_queries, n_keys)
    n_seqs, rows_q = (params.cu_seqlens_q.numel() - 1, params.max_seqlen_q) if params.varlen else (batch, n_queries)
    args = (
        descriptor(q, block_m), descriptor(k, block_n), descriptor(v, block_n), descriptor(o, block_m), o, lse,
        counter, params.cu_seqlens_q, params.cu_seqlens_k, tile_offsets,
        triton.cdiv(rows_q, 2 * block_m), n_seqs * heads_q, heads_q, heads_q // heads_kv, n_queries, n_keys,
        scalars["DIAG"], scalars["WIN_L"], scalars["WIN_R"], o.stride(0), o.stride(2), o.stride(1),
        0 if params.varlen else lse.stride(0), lse.stride(1),
        scalars["qk_scale"], scalars["softcap_in"], scalars["softcap_out"],
    )
    return args, {"HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "STAGES": stages,
                  "STAGE_O": stages_o(head_dim, params.varlen), "REVERSE": params.window_right >= 0,
                  "SOFTCAP": params.softcap > 0, "WINDOW": params.window_left >= 0, "VARLEN": params.varlen}


def tile_offsets(params: Params, heads_q: int, head_dim: int) -> torch.Tensor:
    """A packed batch's query-tile queue: entry b counts the tiles of sequences 0..b-1, times ``heads_q`` (int32,
    batch + 1 entries), computed on the GPU from cu_seqlens without reading them back."""
    rows = 2 * CONFIGS[head_dim][0]
    tiles = (params.cu_seqlens_q.diff() + rows - 1) // rows * heads_q
    return torch.nn.functional.pad(tiles.cumsum(0, dtype=torch.int32), (1, 0))


def gluon_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: Params
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and logsumexp from the warp-specialised sm_90 kernel.

    Args:
        q: (batch, heads_q, seq_q, d), fp16 or bf16, d in (64, 96, 128, 256), on an sm_90 GPU; a packed batch as the
            (1, heads_q, total_q, d) view of its (total_q, heads_q, d) tensor, its sequences in ``params``.
        k, v: (batch, heads_kv, seq_k, d) with heads_q a multiple of heads_kv (packed: as q).
        params: the scores' parameters (:mod:`~cs336_kernels.ops.flash_attention.params`).

    Returns:
        ``(o, lse)``: o shaped, typed and laid out like q (:func:`~cs336_kernels.ops._common.output_like`), lse
        (batch, heads_q, seq_q) in fp32, natural log, contiguous.
    """
    check_inputs(q, k, v, params, "forward")
    o = output_like(q)
    q, k, v = tma_ready(q), tma_ready(k), tma_ready(v)
    batch, heads_q, n_queries, head_dim = q.shape
    lse = torch.empty((batch, heads_q, n_queries), device=q.device, dtype=torch.float32)
    counter = torch.zeros(1, device=q.device, dtype=torch.int32)
    offsets = tile_offsets(params, heads_q, head_dim) if params.varlen else None
    args, constants = forward_args(q, k, v, o, lse, counter, params, offsets)
    n_programs = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if not params.varlen:  # one program per SM, none idle when there are fewer tiles (a packed batch's count stays
        n_programs = min(n_programs, triton.cdiv(n_queries, 2 * constants["BLOCK_M"]) * batch * heads_q)  # on the GPU)
    _attn_fwd_kernel[(n_programs,)](*args, **constants, num_warps=4, maxnreg=MAX_REGISTERS)
    return o, lse
