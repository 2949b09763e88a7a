"""FlashAttention backward for Hopper (sm_90) in Gluon, warp-specialised as in FlashAttention-3 (Shah et al., 2024).

One program owns ``BLOCK_N`` keys of one (batch, key/value head) and runs four partitions:

- a one-warp producer that loads the program's K and V tiles once, then streams the Q and dO tiles of every
  query head of the GQA group, with their rows of L and D, by TMA into a ``STAGES``-deep shared-memory ring
  (so the consumers read L and D from shared memory just before they need them: no global loads, and no
  registers holding them across the products);
- two consumer warpgroups, each owning ``BLOCK_N / 2`` of the keys, that run five wgmma products per
  (query tile, key tile): ``S^T = K Q^T`` and ``dP^T = V dO^T`` (keys as rows, so that P^T and dS^T are
  already the register A operands of the next two), ``dV += P^T dO``, ``dK += dS^T Q``, and
  ``dQ = dS K`` over all the program's keys. Both consumers write their dS^T rows to shared memory and meet at
  a named barrier (FlashAttention-3's exchange); each then computes a part of every dQ tile: half its columns at
  d = 128 (64-query tiles), half its rows at d = 64 (128-query tiles, FlashAttention-4's choice on sm_90). A
  consumer issues dK's product after dQ's so that the tensor cores run it while the consumer stores its dQ part
  into its own staging buffer, once that is free, and hands it to the dQ writer without waiting for the add. dK
  and dV stay in registers until the end;
- a one-warp dQ writer (FlashAttention-4's design) that adds each staged dQ tile in fp32 into a global
  accumulator by a TMA reduce-add (``cp.reduce.async.bulk.tensor``) and frees the buffer as soon as the TMA has
  read it, long before the consumer's next dQ tile is ready.

The accumulator is ours alone, so its rows may be in any order: each dQ tile's rows are staged permuted within
groups of eight (:func:`staged_row`), which makes the consumers' fp32 stores into the 128-byte swizzled staging
buffers free of bank conflicts, and one pass (:func:`unstage_dq`) puts them back in order while it scales dQ and
casts it to the inputs' dtype.

``P^T = exp2(S^T * scale * log2(e) - L * log2(e))`` is recomputed from the forward's logsumexp (read as
``L * log2(e)``, made once per row before the kernel) and ``dS^T = P^T * (dP^T - D)`` uses ``D = rowsum(dO * O)``.
The softmax scale of dK = scale * dS^T Q and dQ = scale * dS K is applied once to each output element (dK at the
end, dQ in the unstaging pass) rather than to every element of every dS^T tile: one multiply fewer per score.
Rows past the end of a head read as zeros by TMA, so they add nothing to any product and need no masks; only tiles
that straddle the causal diagonal are masked. The reduce-adds land in an order that varies from run to run, so dQ is
not bitwise reproducible (dK and dV are: each program owns its keys and sums the query heads of its group in a fixed
order), except under ``torch.use_deterministic_algorithms(True)``: then the key blocks of a head are launched last
first and each adds into a dQ tile only once every later key block has (FlashAttention-3's deterministic mode),
counted by a lock per tile. The dQ writer spins on the lock before it issues a tile's adds, waits for them to
complete and then counts them as landed (a GPU-scope release); the consumers never touch the lock, and wait for it
only if the writer still spins for their previous dQ tile when the next one is ready. Launching the longest programs
last and the waits cost some speed; dQ is then bitwise reproducible.

The kernels need an sm_90 GPU; they do not run in the Triton interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cs336_kernels.ops._common import output_like
from cs336_kernels.ops.flash_attention.backward import backward_rows, bwd_preprocess_kernel
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
)
from cs336_kernels.ops.flash_attention.params import Params

# Per head dim: (BLOCK_M queries per tile, BLOCK_N keys per program, STAGES of the Q/dO ring). Shared memory
# at d = 128: K, V 2 x 32 KiB, Q/dO ring 2 x 32 KiB, dS^T 2 x 16 KiB, dQ staging 2 x 16 KiB, L/D ring 1 KiB =
# 193 KiB of the 227 an sm_90 block may have; at d = 64: K, V 2 x 16 KiB, Q/dO ring 2 x 32 KiB, dS^T 2 x 32 KiB,
# dQ staging 2 x 16 KiB, L/D ring 2 KiB = 194 KiB. d = 96 runs d = 128's tiles (its columns past 96 zeros).
CONFIGS = {64: (128, 128, 2), 96: (64, 128, 2), 128: (64, 128, 2)}


@gluon.constexpr_function
def dq_part(block_m, block_d):
    """The (rows, columns) of the dQ tile part each consumer computes, stages and hands to the dQ writer every
    query tile: with 128-column tiles half the columns of a 64-row tile, at d = 64 half the rows of a 128-row one."""
    return [block_m, block_d // 2] if block_d == 128 else [block_m // 2, block_d]


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    # Triton 3.6 builds this op (an fp32 add of a shared-memory tile into global memory by TMA) but its Gluon
    # has no Python wrapper for it; this mirrors tma.async_copy_shared_to_global.
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _load_acquire(ptr):
    # How many key blocks' reduce-adds into a dQ tile have landed (every thread of the partition reads it).
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _fence_async_global():
    # Orders this thread's generic-proxy accesses (the lock) against its async-proxy ones (the reduce-adds).
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _wait_reduce_adds():
    # Waits until this thread's reduce-adds have been written to global memory, not only read from shared memory
    # (``cp.async.bulk.wait_group`` without ``.read``, which tma.store_wait does not emit).
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.b32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _consumers_barrier():
    # Both consumer warpgroups (256 threads) on named barrier 10, which Triton's own barriers (0-2) leave free; the
    # writers' fence_async_shared before it makes their dS^T stores visible to the wgmma that reads them after it.
    gl.inline_asm_elementwise("bar.sync 10, 256; mov.b32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _bwd_dq_writer(
    dq_desc, DQ_LOCKS, dq_bufs, dq_full, dq_free, b_row, h_kv, H_Q, pid_n, q_first, n_q, lock_tiles, dq_row0, n_k,
    diag, WIN_L, WIN_R, GROUP, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    DETERMINISTIC: gl.constexpr,
):
    # Adds the consumers' staged dQ tiles into the accumulator in the consumers' tile order and frees each
    # staging buffer as soon as its reduce-add has read it. In deterministic mode it first waits until the later
    # key blocks have added into the tile, and counts the tile's adds as landed once they have completed: the spin
    # on the lock and the GPU-scope release wait here, not in a consumer.
    SPLIT_DQ: gl.constexpr = BLOCK_D == 128
    DQ_ROWS: gl.constexpr = dq_part(BLOCK_M, BLOCK_D)[0]
    DQ_COLS: gl.constexpr = dq_part(BLOCK_M, BLOCK_D)[1]
    for t in range(GROUP * n_q):
        h = h_kv * GROUP + t // n_q
        i = q_first + t % n_q
        row = dq_row0 + i * BLOCK_M  # the tile's first row in the accumulator
        if DETERMINISTIC:
            lock = DQ_LOCKS + (b_row * H_Q + h).to(gl.int64) * lock_tiles + row // BLOCK_M
            # The key blocks that add before this one: those after it that see tile i (a band of blocks).
            last = tile_ranges(i * BLOCK_M + diag, BLOCK_M, n_k, WIN_L, WIN_R, BLOCK_N)[3] - 1
            landed = _load_acquire(lock)
            while landed < last - pid_n:
                landed = _load_acquire(lock)
            _fence_async_global()
        # Each consumer's part of tile t, its t-th: a column half (d = 128) or a row half (d = 64).
        for half in gl.static_range(2):
            mbarrier.wait(dq_full.index(half), t & 1)
            if SPLIT_DQ:
                _tma_reduce_add(dq_desc, [b_row, h, row, half * DQ_COLS], dq_bufs.index(half))
            else:
                _tma_reduce_add(dq_desc, [b_row, h, row + half * DQ_ROWS, 0], dq_bufs.index(half))
            tma.store_wait(0)
            mbarrier.arrive(dq_free.index(half))
        if DETERMINISTIC:
            # The fence orders the adds' completion before the release; the barrier holds the warp until the
            # thread that issued them has seen them complete.
            _wait_reduce_adds()
            _fence_async_global()
            thread_barrier()
            gl.atomic_add(lock, 1, sem="release", scope="gpu")


@gluon.jit
def _bwd_producer(
    q_desc, k_desc, v_desc, do_desc, l_desc, d_desc, bufs, b_row, h_kv, k0, q_first, n_q, q_start, l_start, GROUP,
    BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
):
    # k0 and q_start are rows of the (batch, head, row, d) tensors: a packed batch's sequence starts at its first row.
    # L and D are read along their rows, where a TMA box must start 16-byte aligned: a packed batch's are laid out
    # as the dQ accumulator is, its sequence's rows from l_start, a whole tile.
    k_buf, v_buf, q_bufs, do_bufs, l_bufs, d_bufs, ds_bufs, kv_ready, qdo_ready, qdo_empty = bufs
    mbarrier.expect(kv_ready.index(0), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [b_row, h_kv, k0, 0], kv_ready.index(0), k_buf)
    tma_load(v_desc, [b_row, h_kv, k0, 0], kv_ready.index(0), v_buf)
    for t in range(GROUP * n_q):
        h = h_kv * GROUP + t // n_q
        tile = (q_first + t % n_q) * BLOCK_M
        stage = t % STAGES
        # A fresh mbarrier counts as having completed the phase before phase 0: the first pass does not wait.
        mbarrier.wait(qdo_empty.index(stage), ((t // STAGES) & 1) ^ 1)
        ready = qdo_ready.index(stage)
        mbarrier.expect(ready, q_desc.block_type.nbytes + do_desc.block_type.nbytes + l_desc.block_type.nbytes
                        + d_desc.block_type.nbytes)
        tma_load(q_desc, [b_row, h, q_start + tile, 0], ready, q_bufs.index(stage))
        tma_load(do_desc, [b_row, h, q_start + tile, 0], ready, do_bufs.index(stage))
        tma_load(l_desc, [b_row, h, l_start + tile], ready, l_bufs.index(stage))
        tma_load(d_desc, [b_row, h, l_start + tile], ready, d_bufs.index(stage))


@gluon.jit
def _store_rows(OUT, strides, x, b_row, h, start, rows, cols, N_ROWS, N_COLS: gl.constexpr):
    # x's rows `rows` (those before N_ROWS) and columns `cols` (those before N_COLS) into rows start + rows of head
    # (b_row, h) of OUT, whose (batch, head, row) strides are `strides`.
    base = b_row.to(gl.int64) * strides[0] + h.to(gl.int64) * strides[1]
    rows_at = (start + rows)[:, None].to(gl.int64) * strides[2]
    keep = rows[:, None] < N_ROWS
    if x.shape[1] > N_COLS:
        keep = keep & (cols[None, :] < N_COLS)
    gl.store(OUT + base + rows_at + cols[None, :], x, mask=keep)


@gluon.jit
def _bwd_consumer(
    args, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_D: gl.constexpr, STAGES: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr,
):
    (DK, DV, dk_strides, dv_strides, bufs, dq_bufs, dq_full, dq_free, b_row, h_kv, pid_n, q_first, n_q, full_lo,
     full_hi, k_start, n_k, n_queries, diag, WIN_L, WIN_R, GROUP, qk_scale, softcap_in, softcap_out, sm_scale) = args
    k_buf, v_buf, q_bufs, do_bufs, l_bufs, d_bufs, ds_bufs, kv_ready, qdo_ready, qdo_empty = bufs
    dtype: gl.constexpr = k_buf.dtype
    KEYS: gl.constexpr = BLOCK_N // 2
    # Each consumer computes a (64, 64) fp32 part of every dQ tile (32 registers a thread): with 128-column tiles
    # half the columns of a 64-query tile, at d = 64 half the rows of a 128-query one.
    SPLIT_DQ: gl.constexpr = BLOCK_D == 128
    DQ_ROWS: gl.constexpr = dq_part(BLOCK_M, BLOCK_D)[0]
    DQ_COLS: gl.constexpr = dq_part(BLOCK_M, BLOCK_D)[1]
    k0 = pid_n * BLOCK_N
    s_layout: gl.constexpr = mma_layout(BLOCK_M)
    kv_layout: gl.constexpr = mma_layout(BLOCK_D)
    dq_layout: gl.constexpr = mma_layout(DQ_COLS)
    # P^T and dS^T feed dV += P^T dO and dK += dS^T Q from registers; for 16-bit types this layout holds the
    # same elements per thread as the S^T accumulator, so the conversion moves no data.
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    k_all = k_buf.reshape([BLOCK_N, BLOCK_D])
    k_own = k_all.slice(CONSUMER * KEYS, KEYS, dim=0)
    v_own = v_buf.reshape([BLOCK_N, BLOCK_D]).slice(CONSUMER * KEYS, KEYS, dim=0)
    k_dq = k_all.slice(CONSUMER * DQ_COLS, DQ_COLS, dim=1) if SPLIT_DQ else k_all
    # d = 64 puts off dV's product until dS^T is made, so that P^T's and dP^T's 128 fp32 registers a thread do
    # not live beside dV's product in flight (d = 128's 64-query tiles leave room for it).
    LATE_DV: gl.constexpr = BLOCK_D == 64
    offs_k = k0 + CONSUMER * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    # Key j is seen by queries j - diag - WIN_R .. j - diag + WIN_L: one comparison a score against a per-key bound
    # (a second one only for a bounded left side).
    first_q = offs_k - diag - WIN_R
    last_q = offs_k - diag + WIN_L
    inv_cap = 1.0 / softcap_out  # unused without a softcap
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, layout=dq_layout)
    dk = gl.zeros([KEYS, BLOCK_D], gl.float32, layout=kv_layout)
    dv = gl.zeros([KEYS, BLOCK_D], gl.float32, layout=kv_layout)
    mbarrier.wait(kv_ready.index(0), 0)

    for t in range(GROUP * n_q):
        i = q_first + t % n_q
        stage = t % STAGES
        slot = t % 2
        q_smem = q_bufs.index(stage).reshape([BLOCK_M, BLOCK_D])
        do_smem = do_bufs.index(stage).reshape([BLOCK_M, BLOCK_D])
        offs_q = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s)
        mbarrier.wait(qdo_ready.index(stage), (t // STAGES) & 1)
        s_t = warpgroup_mma(k_own, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_own, do_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_t = warpgroup_mma_wait(1, deps=(s_t,))
        # A dense batch's query rows past the end read L = D = 0 (TMA fills them with zeros); their Q and dO rows
        # are zeros too, so they add nothing. A packed batch's rows past its sequence's end (and keys past it) are
        # its neighbour's: masked, in the tiles that hold them.
        lse2 = l_bufs.index(stage).reshape([BLOCK_M]).load(col_s)  # L * log2(e), +inf for a row that sees no key
        if SOFTCAP:
            s_t = tanh(s_t * softcap_in) * softcap_out  # log2 units: qk_scale is 1
        # Without a window a dense batch's tile past full_hi (its last, partial one) needs no mask: its rows see
        # every key of this tile that the full tiles' rows before them see, and its rows past the end add nothing.
        masked = (i < full_lo) | (i >= full_hi) if WINDOW or VARLEN else i < full_lo
        if masked:
            keep = offs_q[None, :] >= first_q[:, None]
            if WINDOW:
                keep = keep & (offs_q[None, :] <= last_q[:, None])
            if VARLEN:
                keep = keep & (offs_q[None, :] < n_queries) & (offs_k[:, None] < n_k)
            s_t = gl.where(keep, s_t, float("-inf"))
        p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
        if not LATE_DV:
            p16 = gl.convert_layout(p_t.to(dtype), a_layout)
            dv = warpgroup_mma(p16, do_smem, dv, is_async=True)
            dp_t = warpgroup_mma_wait(1, deps=(dp_t,))
        else:
            dp_t = warpgroup_mma_wait(0, deps=(dp_t,))
        delta = d_bufs.index(stage).reshape([BLOCK_M]).load(col_s)
        if SOFTCAP:
            # dS = P * (dP - D) * (1 - t^2) with t = tanh(x / cap) read back from P (t = (log2 P + L log2(e)) /
            # (cap log2(e))) rather than kept in registers beside dP; a P of 0 (masked) gives any finite t.
            lse2 = l_bufs.index(stage).reshape([BLOCK_M]).load(col_s)
            t_t = (gl.log2(gl.maximum(p_t, 1.1754944e-38)) + lse2[None, :]) * inv_cap
            ds16 = (p_t * (dp_t - delta[None, :]) * (1.0 - t_t * t_t)).to(dtype)
        else:
            ds16 = (p_t * (dp_t - delta[None, :])).to(dtype)
        ds_bufs.index(slot).slice(CONSUMER * KEYS, KEYS, dim=0).store(ds16)
        fence_async_shared()
        if LATE_DV:
            p16 = gl.convert_layout(p_t.to(dtype), a_layout)
            dv = warpgroup_mma(p16, do_smem, dv, is_async=True)
        ds16 = gl.convert_layout(ds16, a_layout)
        # dQ needs both consumers' dS^T rows. The slot is rewritten two tiles later, once this consumer has passed
        # the next tile's barrier, which the other reaches only after its dQ product of this tile has completed.
        _consumers_barrier()
        if SPLIT_DQ:
            ds_dq = ds_bufs.index(slot).permute((1, 0))
        else:
            ds_dq = ds_bufs.index(slot).slice(CONSUMER * DQ_ROWS, DQ_ROWS, dim=1).permute((1, 0))
        dq = warpgroup_mma(ds_dq, k_dq, dq_zero, use_acc=False, is_async=True)
        # Issued after dQ, so that the tensor cores run it while this consumer stages dQ (below).
        dk = warpgroup_mma(ds16, q_smem, dk, is_async=True)
        # Groups retire in order: dV and dQ are done, dK may still run.
        dq, p16 = warpgroup_mma_wait(1, deps=(dq, p16))
        # This consumer's staging buffer, once the dQ writer's reduce-add has read its previous part (a fresh
        # mbarrier counts as having completed the phase before phase 0: the first tile does not wait).
        dq_tile = dq_bufs.index(CONSUMER)
        mbarrier.wait(dq_free.index(CONSUMER), (t & 1) ^ 1)
        # Part row 8a + 4b + 2c + d goes to staging row 8a + 4c + 2d + b (staged_row). A store instruction writes
        # 32 bytes of each of eight rows, and a half-warp four of them; in row order the swizzle maps rows 2j and
        # 2j + 1 onto the same banks (two wavefronts where one suffices), in this order the four rows differ in
        # the swizzle's upper bits and fill the 32 banks once.
        dq = dq.reshape([DQ_ROWS // 8, 2, 2, 2, DQ_COLS]).permute((0, 2, 3, 1, 4)).reshape([DQ_ROWS, DQ_COLS])
        dq_tile.reshape([DQ_ROWS, DQ_COLS]).store(dq)
        fence_async_shared()
        mbarrier.arrive(dq_full.index(CONSUMER))
        dk, dv, ds16 = warpgroup_mma_wait(0, deps=(dk, dv, ds16))
        mbarrier.arrive(qdo_empty.index(stage))

    # dK, dV rows past the end of the keys and columns past the head dim are dropped by the mask.
    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, kv_layout))
    rows = k0 + CONSUMER * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, kv_layout))
    _store_rows(DK, dk_strides, (dk * sm_scale).to(dtype), b_row, h_kv, k_start, rows, offs_d, n_k, HEAD_DIM)
    _store_rows(DV, dv_strides, dv.to(dtype), b_row, h_kv, k_start, rows, offs_d, n_k, HEAD_DIM)


# Lengths and head counts only enter comparisons and offsets: one build serves them all.
@gluon.jit(do_not_specialize=["H_KV", "GROUP", "N_QUERIES", "N_KEYS", "DIAG", "WIN_L", "WIN_R", "LOCK_TILES"])
def _attn_bwd_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, l_desc, d_desc, DK, DV, DQ_LOCKS, CU_Q, CU_K, PAD_Q,
    stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
    H_KV, GROUP, N_QUERIES, N_KEYS, DIAG, WIN_L, WIN_R, LOCK_TILES, qk_scale, softcap_in, softcap_out, sm_scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    SOFTCAP: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr, DETERMINISTIC: gl.constexpr,
):
    # Grid: (key tiles of the longest sequence, sequences * key/value heads). Under a causal mask programs with the
    # first keys see the most queries and start first, except in deterministic mode: there the key blocks of a head
    # start last first, the order in which they add into dQ, so that a program only ever waits for programs launched
    # before it.
    pid_bh = gl.program_id(1)
    b = pid_bh // H_KV
    h_kv = pid_bh % H_KV
    pid_n = gl.num_programs(0) - 1 - gl.program_id(0) if DETERMINISTIC else gl.program_id(0)
    q_start, n_queries, k_start, n_k, diag = sequence(CU_Q, CU_K, b, N_QUERIES, N_KEYS, DIAG, VARLEN)
    k0 = pid_n * BLOCK_N
    # Query tiles [q_first, q_first + n_q) see at least one of the keys; those outside [full_lo, full_hi) hold a
    # (query, key) pair that is not seen, and a packed batch's key tile past its sequence's end is masked whole.
    q_first, full_lo, full_hi, q_end = tile_ranges(k0 - diag, BLOCK_N, n_queries, WIN_R, WIN_L, BLOCK_M)
    n_q = q_end - q_first
    if VARLEN:
        # A shorter sequence has fewer key tiles than the grid: its programs past them run no query tile (and store
        # nothing). They go through the partitions all the same: a warp-specialised program must not return early.
        n_q = gl.where(k0 < n_k, n_q, 0)
        if k0 + BLOCK_N > n_k:
            full_hi = full_lo
        b_row = 0  # a packed batch's tensors are (1, heads, total, d) views: a sequence is told by its first row
        dq_row0 = gl.load(PAD_Q + b)  # its dQ, L and D tiles start at a whole tile of the accumulator's rows
    else:
        b_row = b
        dq_row0 = 0

    dtype: gl.constexpr = q_desc.dtype
    BLOCK_D: gl.constexpr = q_desc.block_type.shape[3]  # HEAD_DIM rounded up to a power of two
    k_buf = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_buf = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    l_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + l_desc.block_type.shape, l_desc.layout)
    d_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + d_desc.block_type.shape, d_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # Per consumer's staging buffer: staged by the consumer (full), read by the dQ writer's reduce-add (free).
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready.index(0), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(qdo_ready.index(s), count=1)
        # Both consumers read every Q and dO tile; each releases it once.
        mbarrier.init(qdo_empty.index(s), count=2)
    for s in gl.static_range(2):
        mbarrier.init(dq_full.index(s), count=1)
        mbarrier.init(dq_free.index(s), count=1)

    bufs = (k_buf, v_buf, q_bufs, do_bufs, l_bufs, d_bufs, ds_bufs, kv_ready, qdo_ready, qdo_empty)
    dk_strides = (stride_dkb, stride_dkh, stride_dkt)
    dv_strides = (stride_dvb, stride_dvh, stride_dvt)
    consumer_args = (DK, DV, dk_strides, dv_strides, bufs, dq_bufs, dq_full, dq_free, b_row, h_kv, pid_n, q_first,
                     n_q, full_lo, full_hi, k_start, n_k, n_queries, diag, WIN_L, WIN_R, GROUP, qk_scale, softcap_in,
                     softcap_out, sm_scale)
    gl.warp_specialize(
        [
            (_bwd_consumer, (consumer_args, 0, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, STAGES, SOFTCAP, WINDOW,
                             VARLEN)),
            (_bwd_consumer, (consumer_args, 1, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, STAGES, SOFTCAP, WINDOW,
                             VARLEN)),
            (_bwd_producer, (q_desc, k_desc, v_desc, do_desc, l_desc, d_desc, bufs, b_row, h_kv, k_start + k0,
                             q_first, n_q, q_start, dq_row0, GROUP, BLOCK_M, STAGES)),
            (_bwd_dq_writer, (dq_desc, DQ_LOCKS, dq_bufs, dq_full, dq_free, b_row, h_kv, H_KV * GROUP, pid_n,
                              q_first, n_q, LOCK_TILES, dq_row0, n_k, diag, WIN_L, WIN_R, GROUP, BLOCK_M, BLOCK_N,
                              BLOCK_D, DETERMINISTIC)),
        ],
        [4, 1, 1],
        [CONSUMER_REGISTERS, PRODUCER_REGISTERS, PRODUCER_REGISTERS],
    )


@triton.jit
def staged_row(r):
    """The staging row of dQ tile row ``r = 8a + 4b + 2c + d``: ``8a + 4c + 2d + b`` (the consumers' store order)."""
    return (r & ~7) | ((r & 3) << 1) | ((r >> 2) & 1)


@triton.jit
def _dq_unstage_kernel(ACC, DQ, CU_Q, PAD_Q, scale, stride_b, stride_h, stride_t, HEADS, N_QUERIES, ROWS,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr):
    # ACC: (batch * heads, ROWS, HEAD_DIM) fp32 whose BLOCK_M-row tiles hold their rows in staged order (a packed
    # batch: (heads, ROWS, HEAD_DIM), sequence b's tiles from row PAD_Q[b]); DQ: (batch, heads, N_QUERIES, HEAD_DIM)
    # with these strides (packed: its rows CU_Q[b]..CU_Q[b + 1] are sequence b's), in row order, times scale. Each
    # program moves one tile of one (sequence, head).
    pid = tl.program_id(1).to(tl.int64)
    b = pid // HEADS
    h = pid % HEADS
    r = tl.arange(0, BLOCK_M)
    row0 = tl.program_id(0) * BLOCK_M
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        n_q = tl.load(CU_Q + b + 1) - q_start
        acc_row0 = h * ROWS + tl.load(PAD_Q + b) + row0
        b = 0
    else:
        q_start = 0
        n_q = N_QUERIES
        acc_row0 = pid * ROWS + row0
    if row0 >= n_q:
        return
    cols = tl.arange(0, BLOCK_D)
    in_d = cols[None, :] < HEAD_DIM
    acc = tl.load(ACC + (acc_row0 + staged_row(r))[:, None] * HEAD_DIM + cols[None, :], mask=in_d)
    rows = row0 + r
    out = DQ + b * stride_b + h * stride_h + (q_start + rows)[:, None].to(tl.int64) * stride_t
    tl.store(out + cols[None, :], (acc * scale).to(DQ.dtype.element_ty), mask=(rows < n_q)[:, None] & in_d)


def unstage_dq(acc: torch.Tensor, dq: torch.Tensor, scale: float, params: Params | None = None,
               pad_q: torch.Tensor | None = None) -> torch.Tensor:
    """Writes into ``dq`` (batch, heads, n_queries, d), any strides with a unit one on d, ``scale`` times the
    backward's fp32 accumulator ``acc`` (batch, heads, rows, d; rows a multiple of the query tile and at least
    n_queries, each tile's rows in :func:`staged_row` order), in row order and ``dq``'s dtype; returns ``dq``. A
    packed batch (``params`` with its sequences, ``dq`` its (1, heads, total, d) view) has sequence b's tiles from
    accumulator row ``pad_q[b]`` (:func:`padded_starts`)."""
    batch, heads, rows, head_dim = acc.shape
    block_m = CONFIGS[head_dim][0]
    n_queries = dq.shape[2]
    if rows % block_m or not 0 < n_queries <= rows or not acc.is_contiguous() or acc.dtype != torch.float32:
        raise ValueError(f"acc must be a contiguous fp32 (batch, heads, rows, d) with rows a multiple of {block_m} "
                         f"and at least n_queries = {n_queries}; got {acc.dtype} {tuple(acc.shape)}")
    if dq.shape != (batch, heads, n_queries, head_dim) or dq.stride(-1) != 1:
        raise ValueError(f"dq must be ({batch}, {heads}, n_queries, {head_dim}) with a unit stride on d; got "
                         f"{tuple(dq.shape)} with strides {dq.stride()}")
    varlen = params is not None and params.varlen
    if varlen:
        grid = (triton.cdiv(params.max_seqlen_q, block_m), (params.cu_seqlens_q.numel() - 1) * heads)
    else:
        grid = (rows // block_m, batch * heads)
    _dq_unstage_kernel[grid](acc, dq, params.cu_seqlens_q if varlen else None, pad_q, scale, *dq.stride()[:3], heads,
                             n_queries, rows, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
                             BLOCK_M=block_m, VARLEN=varlen)
    return dq


def padded_starts(params: Params, head_dim: int) -> tuple[torch.Tensor, int]:
    """Where each sequence of a packed batch starts in the dQ accumulator, each at a whole query tile (int32, batch +
    1 entries, computed on the GPU), and the accumulator's rows (enough for any lengths of that total)."""
    block_m = CONFIGS[head_dim][0]
    tiles = (params.cu_seqlens_q.diff() + block_m - 1) // block_m * block_m
    n_seqs = params.cu_seqlens_q.numel() - 1
    return torch.nn.functional.pad(tiles.cumsum(0, dtype=torch.int32), (1, 0)), n_seqs * block_m


def _rows_like_accumulator(x: torch.Tensor, cu_seqlens: torch.Tensor, pad: torch.Tensor, rows: int) -> torch.Tensor:
    # A packed batch's (1, heads, total) rows laid out as its dQ accumulator's, (1, heads, rows) with sequence b's
    # from row pad[b] (zeros between): a TMA box must start 16-byte aligned along its innermost dimension, and the
    # backward reads these along theirs (a sequence may start at any token; a tile start is aligned).
    token = torch.arange(x.shape[-1], device=x.device)
    seq = torch.searchsorted(cu_seqlens[1:], token, right=True)  # an empty sequence owns no token
    out = x.new_zeros(x.shape[:-1] + (rows,))
    out[..., pad[seq] + token - cu_seqlens[seq]] = x
    return out


def _row_descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    # (1, 1, rows) boxes of a (batch, heads, seq) fp32 tensor; a 256-byte row of one box takes no swizzle.
    return TensorDescriptor.from_tensor(x, [1, 1, block_rows], gl.NVMMASharedLayout(0, 32, rank=3))


def _padded_rows(shape: torch.Size, device: torch.device) -> torch.Tensor:
    # A (batch, heads, seq) fp32 view whose head stride is a multiple of 4 elements, as TMA needs 16-byte strides.
    batch, heads, n = shape
    return torch.empty((batch, heads, -(-n // 4) * 4), device=device, dtype=torch.float32)[..., :n]


def backward_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse2: torch.Tensor, delta: torch.Tensor,
    dq_acc: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dq_locks: torch.Tensor | None, params: Params,
    pad_q: torch.Tensor | None = None,
) -> tuple[tuple, dict]:
    """The backward kernel's arguments and constexprs for these (B, H, T, d) tensors (a packed batch's (1, H, total,
    d) views, with ``pad_q`` from :func:`padded_starts`), for the launcher and offline builds; ``lse2`` (the
    forward's logsumexp times log2(e), +inf for a row that sees no key) and ``delta`` (batch, heads_q, seq_q) fp32
    with 16-byte-aligned strides (a packed batch's (1, heads_q, rows) laid out as ``dq_acc``), ``dq_acc`` the zeroed
    fp32 accumulator (batch, heads_q, rows, d: seq_q rounded up to whole query tiles, or a packed batch's padded
    rows) that :func:`unstage_dq` reads and scales, dK and dV with a unit stride on d, and ``dq_locks`` the zeroed
    int32 locks of the deterministic mode (one per query tile of the accumulator) or None for the default one."""
    heads_q, n_queries, head_dim = q.shape[1:]
    heads_kv, n_keys = k.shape[1], k.shape[2]
    block_m, block_n, stages = CONFIGS[head_dim]
    scalars = params.kernel_args(n_queries, n_keys)
    dq_block = [1, 1, *dq_part(block_m, triton.next_power_of_2(head_dim))]
    dq_desc = TensorDescriptor.from_tensor(dq_acc, dq_block, gl.NVMMASharedLayout.get_default_for(dq_block, gl.float32))
    args = (
        descriptor(q, block_m), descriptor(k, block_n), descriptor(v, block_n), descriptor(do, block_m), dq_desc,
        _row_descriptor(lse2, block_m), _row_descriptor(delta, block_m), dk, dv, dq_locks, params.cu_seqlens_q,
        params.cu_seqlens_k, pad_q, *dk.stride()[:3], *dv.stride()[:3],
        heads_kv, heads_q // heads_kv, n_queries, n_keys, scalars["DIAG"], scalars["WIN_L"], scalars["WIN_R"],
        dq_acc.shape[2] // block_m, scalars["qk_scale"], scalars["softcap_in"], scalars["softcap_out"],
        params.softmax_scale,
    )
    return args, {"HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "STAGES": stages,
                  "SOFTCAP": params.softcap > 0, "WINDOW": params.window_left >= 0, "VARLEN": params.varlen,
                  "DETERMINISTIC": dq_locks is not None}


def gluon_attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, params: Params,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV from the warp-specialised sm_90 kernel, given the forward's output and logsumexp.

    Args:
        q, k, v, params: as for :func:`~cs336_kernels.ops.flash_attention.gluon_forward.gluon_attention_forward`.
        o: the forward's output, shaped like q.
        do: the gradient of the loss with respect to o, shaped like q.
        lse: the forward's logsumexp, (batch, heads_q, seq_q), fp32, natural log.
        dlse: the logsumexp's gradient, like lse, or None.

    Returns:
        ``(dq, dk, dv)`` shaped, typed and laid out like q, k, v (:func:`~cs336_kernels.ops._common.output_like`).
        dK and dV are bitwise reproducible. dQ's fp32 reduce-adds land in whatever order they come, unless
        ``torch.are_deterministic_algorithms_enabled()``: then each (query head, query tile) takes its key blocks'
        adds in descending key order, so dQ is bitwise reproducible too.
    """
    check_inputs(q, k, v, params, "backward")
    if o.shape != q.shape or do.shape != q.shape or o.dtype != q.dtype or do.dtype != q.dtype:
        raise ValueError(
            f"o and do must be shaped and typed like q {tuple(q.shape)}, {q.dtype}; got "
            f"{tuple(o.shape)}, {o.dtype} and {tuple(do.shape)}, {do.dtype}"
        )
    if lse.shape != q.shape[:-1] or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be fp32 {tuple(q.shape[:-1])} on {q.device}; got {lse.dtype} {tuple(lse.shape)}")
    dq, dk, dv = output_like(q), output_like(k), output_like(v)
    q, k, v, do = tma_ready(q), tma_ready(k), tma_ready(v), tma_ready(do)
    batch, heads_q, n_queries, head_dim = q.shape
    delta = _padded_rows(lse.shape, q.device)  # D = rowsum(dO * O), fp32
    bwd_preprocess_kernel[(triton.cdiv(n_queries, 64), batch * heads_q)](
        o, do, delta, *o.stride(), *do.stride(), delta.stride(0), delta.stride(1), heads_q, n_queries,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=64,
    )
    # The kernel's exponent is in base 2; TMA wants the rows' head stride 16-byte aligned.
    lse2 = _padded_rows(lse.shape, q.device).copy_(backward_rows(lse, delta, dlse))
    # Whole query tiles, so that every tile's staged rows land inside the accumulator; a packed batch's sequences
    # each from a whole tile.
    block_m = CONFIGS[head_dim][0]
    pad_q = None
    rows = triton.cdiv(n_queries, block_m) * block_m
    if params.varlen:
        pad_q, extra = padded_starts(params, head_dim)
        rows += extra
        lse2, delta = (_rows_like_accumulator(t, params.cu_seqlens_q, pad_q, rows) for t in (lse2, delta))
    dq_acc = torch.zeros((batch, heads_q, rows, head_dim), device=q.device, dtype=torch.float32)
    dq_locks = None
    if torch.are_deterministic_algorithms_enabled():
        dq_locks = torch.zeros(batch * heads_q * (rows // block_m), device=q.device, dtype=torch.int32)
    args, constants = backward_args(q, k, v, do, lse2, delta, dq_acc, dk, dv, dq_locks, params, pad_q)
    n_seqs, rows_k = (params.cu_seqlens_q.numel() - 1, params.max_seqlen_k) if params.varlen else (batch, k.shape[2])
    grid = (triton.cdiv(rows_k, constants["BLOCK_N"]), n_seqs * k.shape[1])
    _attn_bwd_kernel[grid](*args, **constants, num_warps=4, maxnreg=MAX_REGISTERS)
    return unstage_dq(dq_acc, dq, params.softmax_scale, params, pad_q), dk, dv
