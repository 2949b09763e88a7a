"""FlashAttention forward for Hopper (sm_90) in Gluon, warp-specialised as in FlashAttention-3 (Shah et al., 2024).

The kernel is persistent: one program per SM takes query tiles of ``2 * BLOCK_M`` rows of one (batch, query head)
from a queue (an atomic counter; head by head, the longest causal tiles of each head first: :func:`_tile_coords`)
until none is left, and runs three partitions:

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
  that completes while the next tile runs.

Conventions are those of :mod:`cs336_kernels.flash_attention`: (batch, heads, seq, d) tensors, grouped-query
attention (query head ``h`` reads key/value head ``h // (Hq // Hkv)``), causal masking aligned top-left
(query ``i`` sees keys ``0..i``), and the logsumexp ``L`` of the scaled scores in natural-log units, fp32.
Key tiles wholly above the diagonal are never loaded; only tiles that straddle it or the end of the keys
are masked. The tensors are addressed by 4-D TMA descriptors, so the hardware zero-fills reads past the
end of a head and clips the O store there: any sequence length works without masked loads.

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

from cs336_kernels.ops._common import LOG2E, output_like
from cs336_kernels.ops.flash_attention.gluon_common import (
    CONSUMER_REGISTERS,
    MAX_REGISTERS,
    PRODUCER_REGISTERS,
    check_inputs,
    descriptor,
    mma_layout,
    thread_barrier,
    tma_load,
    tma_ready,
    tma_store,
)
from cs336_kernels.ops.flash_attention.params import Params

# Per head dim: (BLOCK_M query rows per consumer warpgroup, BLOCK_N keys per tile, STAGES of the K/V ring).
# One wgmma warpgroup covers 64 rows; with the Q and O staging buffers the ring fills most of the 227 KiB of shared
# memory per block: d = 128: 2 x 16 KiB Q + 2 x 16 KiB O + 2 x (32 + 32) KiB K/V; d = 64: 2 x 8 KiB Q + 2 x 8 KiB O
# + 3 x (16 + 16) KiB K/V.
CONFIGS = {64: (64, 128, 3), 128: (64, 128, 2)}


@gluon.jit
def _claim_tile(counter):
    # The next unclaimed tile of the queue (counter counts those claimed), for the calling warp: lane 0 adds one
    # and the warp shares what it read.
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 lane, t; mov.u32 lane, %laneid; setp.eq.u32 p, lane, 0; mov.b32 t, 0; "
        "@p atom.global.add.u32 t, [$1], 1; shfl.sync.idx.b32 $0, t, 0, 31, -1; }",
        "=r,l", [counter], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _tile_coords(tile, n_m, IS_CAUSAL: gl.constexpr):
    # The (batch * query head, query tile) of the tile-th tile of the queue. A head's programs share its K and V
    # through the L2 cache; causal tiles near the end have the most key tiles and go first, so that the last tiles
    # claimed are light ones.
    pid_m = tile % n_m
    if IS_CAUSAL:
        pid_m = n_m - 1 - pid_m
    return tile // n_m, pid_m


@gluon.jit
def _key_tiles(q0, N_KEYS, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    # Key tiles [0, masked_from) are complete and wholly below the diagonal for the 2 * BLOCK_M rows from q0; tiles
    # from there to n_tiles straddle the diagonal or the end of the keys; later tiles are never loaded.
    if IS_CAUSAL:
        n_tiles = gl.cdiv(gl.minimum(q0 + 2 * BLOCK_M, N_KEYS), BLOCK_N)
        masked_from = gl.minimum(q0 // BLOCK_N, N_KEYS // BLOCK_N)
    else:
        n_tiles = gl.cdiv(N_KEYS, BLOCK_N)
        masked_from = N_KEYS // BLOCK_N
    return n_tiles, masked_from


@gluon.jit
def _producer(
    q_desc, k_desc, v_desc, bufs, tile_buf, COUNTER, n_m, BH, H_Q, GROUP, N_KEYS,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
):
    q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = bufs
    id_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    n_total = n_m * BH
    tile = gl.program_id(0)
    it = 0  # ring position of the tile's first key tile
    count = 0  # query tiles handed to the consumers so far
    while tile < n_total:
        # Both consumers are done with the Q buffers and have read the last tile index. A fresh mbarrier counts
        # as having completed the phase before phase 0, so the first wait (and the first pass through the ring)
        # does not block.
        mbarrier.wait(q_empty.index(0), (count & 1) ^ 1)
        tile_buf.store(gl.full([1], tile, gl.int32, layout=id_layout))
        bh, pid_m = _tile_coords(tile, n_m, IS_CAUSAL)
        b = bh // H_Q
        h = bh % H_Q
        h_kv = h // GROUP
        q0 = pid_m * (2 * BLOCK_M)
        n_tiles = _key_tiles(q0, N_KEYS, BLOCK_M, BLOCK_N, IS_CAUSAL)[0]
        for c in gl.static_range(2):
            mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
            tma_load(q_desc, [b, h, q0 + c * BLOCK_M, 0], q_ready.index(c), q_bufs.index(c))
        for j in range(n_tiles):
            stage = (it + j) % STAGES
            phase = (((it + j) // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(stage), phase)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma_load(k_desc, [b, h_kv, j * BLOCK_N, 0], k_ready.index(stage),
                                            k_bufs.index(stage))
            mbarrier.wait(v_empty.index(stage), phase)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma_load(v_desc, [b, h_kv, j * BLOCK_N, 0], v_ready.index(stage),
                                            v_bufs.index(stage))
        it += n_tiles
        count += 1
        tile = _claim_tile(COUNTER) + gl.num_programs(0)
    # No tile left: an index past the end tells the consumers to stop.
    mbarrier.wait(q_empty.index(0), (count & 1) ^ 1)
    tile_buf.store(gl.full([1], tile, gl.int32, layout=id_layout))
    for c in gl.static_range(2):
        mbarrier.arrive(q_ready.index(c))


@gluon.jit
def _scores(s, j, row0, masked_from, N_KEYS, qk_scale, m_i, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    # Scores stay raw (unscaled) so that the row max needs no multiply and exp2(s * scale - m) is one FMA;
    # the scale (sm_scale * log2(e)) is positive, so max and scaling commute. Only tiles from masked_from on
    # straddle the diagonal or the end of the keys.
    if j >= masked_from:
        offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if IS_CAUSAL:
            # Row i sees keys below min(i + 1, N_KEYS): one comparison a score, each key index used once, so
            # ptxas does not keep the tile's key indices in registers for a second pass.
            offs_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            keep = offs_n[None, :] < gl.minimum(offs_m + 1, N_KEYS)[:, None]
        else:
            keep = offs_n[None, :] < N_KEYS
        s = gl.where(keep, s, float("-inf"))
    # Key 0 is in the first tile and visible to every row, so m_new is finite from the first tile on.
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    return p, m_new


@gluon.jit
def _consumer(
    o_desc, L, bufs, o_bufs, tile_buf, n_m, BH, H_Q, N_QUERIES, N_KEYS, qk_scale,
    CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
):
    q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = bufs
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(HEAD_DIM)
    # P feeds the P V wgmma from registers: for 16-bit types this layout holds the same elements per thread as
    # the S accumulator, so the conversion moves no data.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    id_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])

    q_tile = q_bufs.index(CONSUMER)
    q_smem = q_tile.reshape([BLOCK_M, HEAD_DIM])
    o_tile = o_bufs.index(CONSUMER)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    n_total = n_m * BH
    it = 0  # ring position of the tile's first key tile
    count = 0  # query tiles done
    mbarrier.wait(q_ready.index(CONSUMER), 0)
    tile = gl.max(tile_buf.load(id_layout), axis=0)
    while tile < n_total:
        pid_m = _tile_coords(tile, n_m, IS_CAUSAL)[1]
        q0 = pid_m * (2 * BLOCK_M)
        n_tiles, masked_from = _key_tiles(q0, N_KEYS, BLOCK_M, BLOCK_N, IS_CAUSAL)
        row0 = q0 + CONSUMER * BLOCK_M
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)

        # Key tile 0: scores and probabilities only; its P V is issued together with tile 1's Q K^T.
        stage = it % STAGES
        mbarrier.wait(k_ready.index(stage), (it // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(stage))
        p, m_i = _scores(s, 0, row0, masked_from, N_KEYS, qk_scale, m_i, s_layout, BLOCK_M, BLOCK_N, IS_CAUSAL)
        l_i = gl.sum(p, axis=1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_tiles):
            stage = (it + j) % STAGES
            prev = (it + j - 1) % STAGES
            mbarrier.wait(k_ready.index(stage), ((it + j) // STAGES) & 1)
            s = warpgroup_mma(q_smem, k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((it + j - 1) // STAGES) & 1)
            acc = warpgroup_mma(p16, v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            # wgmma groups retire in order: one outstanding group means Q K^T is done and P V may still run.
            s = warpgroup_mma_wait(1, deps=(s,))
            mbarrier.arrive(k_empty.index(stage))
            p, m_new = _scores(s, j, row0, masked_from, N_KEYS, qk_scale, m_i, s_layout, BLOCK_M, BLOCK_N,
                                IS_CAUSAL)
            alpha = gl.exp2(m_i - m_new)
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
        acc = warpgroup_mma(p16, v_bufs.index(last).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last))

        # Epilogue: O through this consumer's staging buffer once the previous tile's store has read it, then one
        # TMA store, which clips rows past the end of the head (it completes while the next tile runs); L by a
        # masked store.
        acc = acc / gl.convert_layout(l_i, row_o)[:, None]
        # The tile's coordinates again: cheaper than keeping them in registers through the loop.
        bh, pid_m = _tile_coords(tile, n_m, IS_CAUSAL)
        b = bh // H_Q
        h = bh % H_Q
        row0 = pid_m * (2 * BLOCK_M) + CONSUMER * BLOCK_M
        offs_m = row0 + gl.arange(0, BLOCK_M, layout=row_s)
        tma.store_wait(0)
        thread_barrier()
        o_tile.reshape([BLOCK_M, HEAD_DIM]).store(acc.to(dtype))
        fence_async_shared()
        tma_store(o_desc, [b, h, row0, 0], o_tile)
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # natural-log units
        gl.store(L + (b * H_Q + h).to(gl.int64) * N_QUERIES + offs_m, lse, mask=offs_m < N_QUERIES)
        it += n_tiles
        count += 1
        mbarrier.wait(q_ready.index(CONSUMER), count & 1)
        tile = gl.max(tile_buf.load(id_layout), axis=0)
    tma.store_wait(0)


# Lengths and head counts only enter comparisons and offsets: one build serves them all.
@gluon.jit(do_not_specialize=["n_m", "BH", "H_Q", "GROUP", "N_QUERIES", "N_KEYS"])
def _attn_fwd_kernel(
    q_desc, k_desc, v_desc, o_desc, L, COUNTER,
    n_m, BH, H_Q, GROUP, N_QUERIES, N_KEYS, qk_scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
):
    # Persistent: one program per SM takes query tiles of 2 * BLOCK_M rows (n_m per (batch, query head), BH heads)
    # in the order of _tile_coords until none is left, so that one tile's epilogue overlaps the next one's loads.
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    o_bufs = gl.allocate_shared_memory(dtype, [2] + o_desc.block_type.shape, o_desc.layout)
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
    # Both consumers release the Q buffers (and the tile index) once per tile.
    mbarrier.init(q_empty.index(0), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # Both consumers read every K and V tile; each releases it once.
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)

    bufs = (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty)
    gl.warp_specialize(
        [
            (_consumer, (o_desc, L, bufs, o_bufs, tile_buf, n_m, BH, H_Q, N_QUERIES, N_KEYS, qk_scale,
                         0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL)),
            (_consumer, (o_desc, L, bufs, o_bufs, tile_buf, n_m, BH, H_Q, N_QUERIES, N_KEYS, qk_scale,
                         1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL)),
            (_producer, (q_desc, k_desc, v_desc, bufs, tile_buf, COUNTER, n_m, BH, H_Q, GROUP, N_KEYS,
                         BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL)),
        ],
        [4, 1],
        [CONSUMER_REGISTERS, PRODUCER_REGISTERS],
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def forward_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, counter: torch.Tensor,
    params: Params,
) -> tuple[tuple, dict]:
    """The forward kernel's arguments and constexprs for these tensors (for the launcher and offline builds);
    ``counter`` is the zeroed int32 that counts the claimed query tiles."""
    batch, heads_q, n_queries, head_dim = q.shape
    heads_kv, n_keys = k.shape[1], k.shape[2]
    block_m, block_n, stages = CONFIGS[head_dim]
    args = (
        descriptor(q, block_m), descriptor(k, block_n), descriptor(v, block_n), descriptor(o, block_m), lse, counter,
        triton.cdiv(n_queries, 2 * block_m), batch * heads_q, heads_q, heads_q // heads_kv, n_queries, n_keys,
        params.softmax_scale * LOG2E,
    )
    return args, {"HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "STAGES": stages,
                  "IS_CAUSAL": params.window_right == 0}


def gluon_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: Params
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and logsumexp from the warp-specialised sm_90 kernel.

    Args:
        q: (batch, heads_q, seq_q, d), fp16 or bf16, d in (64, 128), on an sm_90 GPU.
        k, v: (batch, heads_kv, seq_k, d) with heads_q a multiple of heads_kv.
        params: the scores' parameters, within what
            :func:`~cs336_kernels.ops.flash_attention.gluon_common.gluon_unsupported` allows.

    Returns:
        ``(o, lse)``: o shaped, typed and laid out like q (:func:`~cs336_kernels.ops._common.output_like`), lse
        (batch, heads_q, seq_q) in fp32, natural log, contiguous.
    """
    check_inputs(q, k, v, params)
    o = output_like(q)
    q, k, v = tma_ready(q), tma_ready(k), tma_ready(v)
    batch, heads_q, n_queries, _ = q.shape
    lse = torch.empty((batch, heads_q, n_queries), device=q.device, dtype=torch.float32)
    counter = torch.zeros(1, device=q.device, dtype=torch.int32)
    args, constants = forward_args(q, k, v, o, lse, counter, params)
    n_tiles = triton.cdiv(n_queries, 2 * constants["BLOCK_M"]) * batch * heads_q
    # One program per SM (none idle when there are fewer tiles).
    n_programs = min(n_tiles, _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device()))
    _attn_fwd_kernel[(n_programs,)](*args, **constants, num_warps=4, maxnreg=MAX_REGISTERS)
    return o, lse
