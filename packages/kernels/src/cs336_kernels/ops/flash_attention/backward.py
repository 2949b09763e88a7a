"""FlashAttention-2 backward in Triton: the D pre-pass, the dK/dV kernel, the dQ kernel and their launcher.

The backward recomputes the probabilities ``P = exp(S - L)`` tile by tile from the saved logsumexp and
uses ``D = rowsum(dO * O)`` in place of the softmax Jacobian. It is two main kernels without atomics,
so it is deterministic: one program per key tile accumulates dK and dV over every query tile (and every
query head of its group), one program per query tile accumulates dQ over every key tile. S and dP are
computed in both, so the backward runs seven matmuls per tile pair instead of five.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cs336_kernels.interpreter import INTERPRET
from cs336_kernels.ops._common import LOG2E, output_like
from cs336_kernels.ops.flash_attention.params import Params
from cs336_kernels.ops.flash_attention.tiles import (
    advance_tile,
    kernel_constants,
    key_tile_ranges,
    launch_geometry,
    load_tile,
    load_tiles,
    query_tile_ranges,
    sequence,
    store_tile,
    tanh,
    tile_ptr,
    tma_descriptors,
    visible,
    with_tma_scratch,
)
from cs336_kernels.ops.flash_attention.tuning import autotune


@triton.jit
def bwd_preprocess_kernel(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_deltab, stride_deltah,
    H_Q, N_QUERIES,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # D = rowsum(dO * O), which equals rowsum(P * dP) and replaces the softmax Jacobian in the backward.
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_Q).to(tl.int64)
    h = (pid_bh % H_Q).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < N_QUERIES) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(
        O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
        mask=mask, other=0.0,
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod,
        mask=mask, other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + b * stride_deltab + h * stride_deltah + offs_m, delta, mask=offs_m < N_QUERIES)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, Q_BASE, DO_BASE, Q_DESC, DO_DESC, L_BASE, DELTA_BASE,
    stride_qt, stride_qd, stride_dot, stride_dod,
    offs_n, lo, hi, n_q, n_k, diag, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
    CHECK_ROWS: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, QDO_TMA: tl.constexpr,
):
    # CHECK_ROWS: tiles that may reach past the last query (bounds-checked loads, L = +inf there); MASKED: tiles
    # with a (query, key) pair outside the window.
    Q_BLOCK = tile_ptr(Q_BASE, n_q, stride_qt, stride_qd, lo, HEAD_DIM, BLOCK_M, BLOCK_D)
    DO_BLOCK = tile_ptr(DO_BASE, n_q, stride_dot, stride_dod, lo, HEAD_DIM, BLOCK_M, BLOCK_D)
    for start in range(lo, hi, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        q, do = load_tiles(Q_BLOCK, DO_BLOCK, Q_DESC, DO_DESC, start, CHECK_ROWS, EVEN_D, QDO_TMA)
        if CHECK_ROWS:
            lse2 = tl.load(L_BASE + offs_m, mask=offs_m < n_q, other=float("inf"))
            delta = tl.load(DELTA_BASE + offs_m, mask=offs_m < n_q, other=0.0)
        else:
            lse2 = tl.load(L_BASE + offs_m)
            delta = tl.load(DELTA_BASE + offs_m)
        # Work with transposed tiles (keys x queries) so that no probability tile needs transposing.
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        if SOFTCAP:
            t_t = tanh(s_t * softcap_in)
            p_t = tl.exp2(t_t * softcap_out - lse2[None, :])
        else:
            p_t = tl.exp2(s_t * qk_scale - lse2[None, :])
        if MASKED:
            p_t = tl.where(visible(offs_m, offs_n, n_k, diag, WIN_L, WIN_R, True, False, WINDOW), p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, acc=dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)  # d(softcap * tanh(x / softcap)) / dx
        dk = tl.dot(ds_t.to(q.dtype), q, acc=dk, input_precision=DOT_PRECISION)
        Q_BLOCK = advance_tile(Q_BLOCK, BLOCK_M)
        DO_BLOCK = advance_tile(DO_BLOCK, BLOCK_M)
    return dk, dv


@autotune("dkdv")
@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, L, DELTA, DK, DV, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dvd,
    stride_lb, stride_lh,
    H_KV, GROUP, N_QUERIES, N_KEYS, DIAG, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QDO_TMA: tl.constexpr = False,
):
    # Grid: (key tiles of the longest sequence, sequences * key/value heads). Each program owns its dK, dV tile:
    # no atomics needed, and a GQA group's query heads are summed here in a fixed order, so dK and dV are
    # deterministic. L holds the logsumexp in log2 units.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    h_kv = (pid_bh % H_KV).to(tl.int64)
    q_start, n_q, k_start, n_k, diag = sequence(CU_Q, CU_K, b, N_QUERIES, N_KEYS, DIAG, VARLEN)
    k0 = pid_n * BLOCK_N
    if k0 >= n_k:  # a packed batch's shorter sequences have fewer key tiles than the grid
        return
    offs_n = k0 + tl.arange(0, BLOCK_N)

    K_BLOCK = tile_ptr(
        K + b * stride_kb + h_kv * stride_kh + k_start * stride_kt, n_k, stride_kt, stride_kd, k0, HEAD_DIM, BLOCK_N,
        BLOCK_D,
    )
    V_BLOCK = tile_ptr(
        V + b * stride_vb + h_kv * stride_vh + k_start * stride_vt, n_k, stride_vt, stride_vd, k0, HEAD_DIM, BLOCK_N,
        BLOCK_D,
    )
    k = load_tile(K_BLOCK, True, EVEN_D)
    v = load_tile(V_BLOCK, True, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Keys past the end of the sequence read as zeros and are dropped at the store: no mask needed for them. The
    # tiles past full_hi hold queries the key tile's window has left (a WINDOW) or the partial last tile (rows past
    # the end have P = 0): masked only for a window.
    lo, full_lo, full_hi, hi = query_tile_ranges(k0, n_q, diag, WIN_L, WIN_R, BLOCK_M, BLOCK_N)
    for g in range(GROUP):
        h = h_kv * GROUP + g
        Q_BASE = Q + b * stride_qb + h * stride_qh + q_start * stride_qt
        DO_BASE = DO + b * stride_dob + h * stride_doh + q_start * stride_dot
        L_BASE = L + b * stride_lb + h * stride_lh + q_start
        DELTA_BASE = DELTA + b * stride_lb + h * stride_lh + q_start
        if QDO_TMA:
            # One descriptor per query head for its three query loops.
            Q_DESC, DO_DESC = tma_descriptors(Q_BASE, DO_BASE, stride_qt, stride_dot, n_q, HEAD_DIM, BLOCK_M, BLOCK_D)
        else:
            Q_DESC, DO_DESC = None, None
        dk, dv = _dkdv_inner(
            dk, dv, k, v, Q_BASE, DO_BASE, Q_DESC, DO_DESC, L_BASE, DELTA_BASE,
            stride_qt, stride_qd, stride_dot, stride_dod,
            offs_n, lo, full_lo, n_q, n_k, diag, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out,
            HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_M, True, True, SOFTCAP, WINDOW, DOT_PRECISION, QDO_TMA,
        )
        dk, dv = _dkdv_inner(
            dk, dv, k, v, Q_BASE, DO_BASE, Q_DESC, DO_DESC, L_BASE, DELTA_BASE,
            stride_qt, stride_qd, stride_dot, stride_dod,
            offs_n, full_lo, full_hi, n_q, n_k, diag, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out,
            HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_M, False, False, SOFTCAP, WINDOW, DOT_PRECISION, QDO_TMA,
        )
        dk, dv = _dkdv_inner(
            dk, dv, k, v, Q_BASE, DO_BASE, Q_DESC, DO_DESC, L_BASE, DELTA_BASE,
            stride_qt, stride_qd, stride_dot, stride_dod,
            offs_n, full_hi, hi, n_q, n_k, diag, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out,
            HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_M, True, WINDOW, SOFTCAP, WINDOW, DOT_PRECISION, QDO_TMA,
        )

    dk = dk * sm_scale
    DK_BLOCK = tile_ptr(
        DK + b * stride_dkb + h_kv * stride_dkh + k_start * stride_dkt, n_k, stride_dkt, stride_dkd, k0, HEAD_DIM,
        BLOCK_N, BLOCK_D,
    )
    DV_BLOCK = tile_ptr(
        DV + b * stride_dvb + h_kv * stride_dvh + k_start * stride_dvt, n_k, stride_dvt, stride_dvd, k0, HEAD_DIM,
        BLOCK_N, BLOCK_D,
    )
    store_tile(DK_BLOCK, dk.to(DK.dtype.element_ty))
    store_tile(DV_BLOCK, dv.to(DV.dtype.element_ty))


@triton.jit
def _dq_inner(
    dq, q, do, lse2, delta, K_BASE, V_BASE, K_DESC, V_DESC,
    stride_kt, stride_kd, stride_vt, stride_vd,
    offs_m, lo, hi, n_q, n_k, diag, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_TMA: tl.constexpr,
):
    K_BLOCK = tile_ptr(K_BASE, n_k, stride_kt, stride_kd, lo, HEAD_DIM, BLOCK_N, BLOCK_D)
    V_BLOCK = tile_ptr(V_BASE, n_k, stride_vt, stride_vd, lo, HEAD_DIM, BLOCK_N, BLOCK_D)
    for start in range(lo, hi, BLOCK_N):
        k, v = load_tiles(K_BLOCK, V_BLOCK, K_DESC, V_DESC, start, MASKED, EVEN_D, KV_TMA)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if SOFTCAP:
            t = tanh(s * softcap_in)
            p = tl.exp2(t * softcap_out - lse2[:, None])
        else:
            p = tl.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            keep = visible(offs_m, start + tl.arange(0, BLOCK_N), n_k, diag, WIN_L, WIN_R, False, False, WINDOW)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, acc=dq, input_precision=DOT_PRECISION)
        K_BLOCK = advance_tile(K_BLOCK, BLOCK_N)
        V_BLOCK = advance_tile(V_BLOCK, BLOCK_N)
    return dq


@autotune("dq")
@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, L, DELTA, DQ, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    stride_lb, stride_lh,
    H_Q, GROUP, N_QUERIES, N_KEYS, DIAG, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_TMA: tl.constexpr = False,
):
    # Grid: (query tiles of the longest sequence, sequences * query heads); the same tile walk as the forward.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_Q).to(tl.int64)
    h = (pid_bh % H_Q).to(tl.int64)
    h_kv = h // GROUP
    q_start, n_q, k_start, n_k, diag = sequence(CU_Q, CU_K, b, N_QUERIES, N_KEYS, DIAG, VARLEN)
    q0 = pid_m * BLOCK_M
    if q0 >= n_q:
        return
    offs_m = q0 + tl.arange(0, BLOCK_M)

    Q_BLOCK = tile_ptr(
        Q + b * stride_qb + h * stride_qh + q_start * stride_qt, n_q, stride_qt, stride_qd, q0, HEAD_DIM, BLOCK_M,
        BLOCK_D,
    )
    DO_BLOCK = tile_ptr(
        DO + b * stride_dob + h * stride_doh + q_start * stride_dot, n_q, stride_dot, stride_dod, q0, HEAD_DIM,
        BLOCK_M, BLOCK_D,
    )
    q = load_tile(Q_BLOCK, True, EVEN_D)
    do = load_tile(DO_BLOCK, True, EVEN_D)
    row_ok = offs_m < n_q
    lse2 = tl.load(L + b * stride_lb + h * stride_lh + q_start + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + b * stride_lb + h * stride_lh + q_start + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = key_tile_ranges(q0, n_k, diag, WIN_L, WIN_R, BLOCK_M, BLOCK_N)
    K_BASE = K + b * stride_kb + h_kv * stride_kh + k_start * stride_kt
    V_BASE = V + b * stride_vb + h_kv * stride_vh + k_start * stride_vt
    if KV_TMA:
        K_DESC, V_DESC = tma_descriptors(K_BASE, V_BASE, stride_kt, stride_vt, n_k, HEAD_DIM, BLOCK_N, BLOCK_D)
    else:
        K_DESC, V_DESC = None, None
    if WINDOW:  # key tiles before full_lo: those the window's left edge crosses (none without a window)
        dq = _dq_inner(
            dq, q, do, lse2, delta, K_BASE, V_BASE, K_DESC, V_DESC, stride_kt, stride_kd, stride_vt, stride_vd,
            offs_m, lo, full_lo, n_q, n_k, diag, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out,
            HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_N, True, SOFTCAP, WINDOW, DOT_PRECISION, KV_TMA,
        )
    dq = _dq_inner(
        dq, q, do, lse2, delta, K_BASE, V_BASE, K_DESC, V_DESC, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, full_lo, full_hi, n_q, n_k, diag, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out,
        HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_N, False, SOFTCAP, WINDOW, DOT_PRECISION, KV_TMA,
    )
    dq = _dq_inner(
        dq, q, do, lse2, delta, K_BASE, V_BASE, K_DESC, V_DESC, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, full_hi, hi, n_q, n_k, diag, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out,
        HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_N, True, SOFTCAP, WINDOW, DOT_PRECISION, KV_TMA,
    )
    dq = dq * sm_scale
    DQ_BLOCK = tile_ptr(
        DQ + b * stride_dqb + h * stride_dqh + q_start * stride_dqt, n_q, stride_dqt, stride_dqd, q0, HEAD_DIM,
        BLOCK_M, BLOCK_D,
    )
    store_tile(DQ_BLOCK, dq.to(DQ.dtype.element_ty))


def backward_rows(lse: torch.Tensor, delta: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """The backward's per-row inputs from the forward's logsumexp and ``D = rowsum(dO * O)`` (written into
    ``delta``, returned): ``L * log2(e)``, the kernels' exponent, with a row that saw no key at ``+inf`` (so that
    its probabilities come out 0, not NaN), and ``D - dL`` when the logsumexp has a gradient (since
    ``dL / dS = P``, it joins dS = P * (dP - D) there)."""
    if dlse is not None:
        delta.sub_(dlse)
    return torch.where(lse == float("-inf"), float("inf"), lse * LOG2E)


def flash_backward_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None, params: Params,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV in the dtypes and layouts of q, k, v (:func:`~cs336_kernels.ops._common.output_like`), from
    (B, H, T, d) tensors with a unit stride on d (a packed batch: (1, H, total, d) views, its sequences in
    ``params``), the saved (B, Hq, Tq) logsumexp and its gradient, if any.

    Three launches (D, dK/dV, dQ), no atomics, bitwise reproducible; the dQ kernel recomputes S and dP,
    so seven matmuls per tile pair.
    """
    batch, heads_q, n_queries, head_dim = q.shape
    heads_kv, n_keys = k.shape[1], k.shape[2]
    constants = kernel_constants(q, params)

    delta = torch.empty_like(lse)
    preprocess_block = 64 if not INTERPRET else 16
    bwd_preprocess_kernel[(triton.cdiv(n_queries, preprocess_block), batch * heads_q)](
        o, do, delta, *o.stride(), *do.stride(), delta.stride(0), delta.stride(1), heads_q, n_queries,
        HEAD_DIM=head_dim, BLOCK_D=constants["BLOCK_D"], BLOCK_M=preprocess_block,
    )
    lse2 = backward_rows(lse, delta, dlse)

    dq, dk, dv = output_like(q), output_like(k), output_like(v)
    group = heads_q // heads_kv
    geometry = launch_geometry(params, q, k)
    strides = [s for t in (q, k, v, do) for s in geometry.strides(t)]
    row_strides = geometry.strides(lse2)[:2]
    scalars = params.kernel_args(n_queries, n_keys) | {"sm_scale": params.softmax_scale}

    def dkdv_grid(meta):
        return (triton.cdiv(geometry.rows_k, meta["BLOCK_N"]), geometry.n_seqs * heads_kv)

    def dq_grid(meta):
        return (triton.cdiv(geometry.rows_q, meta["BLOCK_M"]), geometry.n_seqs * heads_q)

    def launch() -> None:
        _attn_bwd_dkdv_kernel[dkdv_grid](
            q, k, v, do, lse2, delta, dk, dv, params.cu_seqlens_q, params.cu_seqlens_k,
            *strides, *geometry.strides(dk), *geometry.strides(dv), *row_strides,
            heads_kv, group, **scalars, **constants,
        )
        _attn_bwd_dq_kernel[dq_grid](
            q, k, v, do, lse2, delta, dq, params.cu_seqlens_q, params.cu_seqlens_k,
            *strides, *geometry.strides(dq), *row_strides,
            heads_q, group, **scalars, **constants,
        )

    with_tma_scratch(launch)
    return dq, dk, dv
