"""FlashAttention-2 forward (Dao, 2023) in Triton: the kernel and its launcher.

One program per (query tile, batch * query head) folds the key tiles into an fp32 accumulator with an
online softmax (a running row maximum ``m`` and denominator ``l``), in log2 units so that every
exponential is an ``exp2``, and writes the output ``O`` and the natural-log logsumexp ``L`` that the
backward pass reads. Causal: key tiles above the diagonal are never loaded, tiles that straddle it are
masked element-wise, all others run unmasked; heavier query tiles are launched first.

The operator ``torch.ops.cs336.flash_attention_forward`` (:mod:`~cs336_kernels.ops.flash_attention.api`) runs
this kernel or the warp-specialised Gluon one; its ``auto`` choice follows
:func:`~cs336_kernels.ops.flash_attention.gluon_common.gluon_applies`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cs336_kernels.ops._common import output_like
from cs336_kernels.ops.flash_attention.params import Params
from cs336_kernels.ops.flash_attention.tiles import (
    advance_tile,
    kernel_constants,
    key_tile_ranges,
    launch_geometry,
    load_tile,
    load_tiles,
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
def _fwd_inner(
    acc, l_i, m_i, q, K_BASE, V_BASE, K_DESC, V_DESC,
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
        # Scores in log2 units (scale * log2(e) folded in) so the exponentials are exp2. Unmasked tiles
        # take the row max of the raw scores (the scale is positive) and fold the scaling into the
        # subtraction, one FMA per score instead of a multiply and a subtract. A softcap leaves its scores in
        # log2 units already (qk_scale is 1 then).
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if SOFTCAP:
            s = tanh(s * softcap_in) * softcap_out
        if MASKED:
            keep = visible(offs_m, start + tl.arange(0, BLOCK_N), n_k, diag, WIN_L, WIN_R, False, True, WINDOW)
            s = tl.where(keep, s * qk_scale, float("-inf"))
            # A row may have seen no key yet (a window's first tile, Tq > Tk): exponentiate against 0, not -inf.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=DOT_PRECISION)
        m_i = m_new
        K_BLOCK = advance_tile(K_BLOCK, BLOCK_N)
        V_BLOCK = advance_tile(V_BLOCK, BLOCK_N)
    return acc, l_i, m_i


@autotune("fwd")
@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, L, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_lb, stride_lh,
    H_Q, GROUP, N_QUERIES, N_KEYS, DIAG, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_TMA: tl.constexpr = False,
):
    # Grid: (query tiles of the longest sequence, sequences * query heads). Under a causal mask the tiles near
    # the end do the most work; start them first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_Q).to(tl.int64)
    h = (pid_bh % H_Q).to(tl.int64)
    h_kv = h // GROUP
    q_start, n_q, k_start, n_k, diag = sequence(CU_Q, CU_K, b, N_QUERIES, N_KEYS, DIAG, VARLEN)
    q0 = pid_m * BLOCK_M
    if q0 >= n_q:  # a packed batch's shorter sequences have fewer query tiles than the grid
        return

    Q_BLOCK = tile_ptr(
        Q + b * stride_qb + h * stride_qh + q_start * stride_qt, n_q, stride_qt, stride_qd, q0, HEAD_DIM, BLOCK_M,
        BLOCK_D,
    )
    q = load_tile(Q_BLOCK, True, EVEN_D)
    offs_m = q0 + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = key_tile_ranges(q0, n_k, diag, WIN_L, WIN_R, BLOCK_M, BLOCK_N)
    K_BASE = K + b * stride_kb + h_kv * stride_kh + k_start * stride_kt
    V_BASE = V + b * stride_vb + h_kv * stride_vh + k_start * stride_vt
    if KV_TMA:
        # One descriptor per head for the three key loops.
        K_DESC, V_DESC = tma_descriptors(K_BASE, V_BASE, stride_kt, stride_vt, n_k, HEAD_DIM, BLOCK_N, BLOCK_D)
    else:
        K_DESC, V_DESC = None, None
    if WINDOW:  # key tiles before full_lo: those the window's left edge crosses (none without a window)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, K_BASE, V_BASE, K_DESC, V_DESC, stride_kt, stride_kd, stride_vt, stride_vd,
            offs_m, lo, full_lo, n_q, n_k, diag, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out,
            HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_N, True, SOFTCAP, WINDOW, DOT_PRECISION, KV_TMA,
        )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, K_BASE, V_BASE, K_DESC, V_DESC, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, full_lo, full_hi, n_q, n_k, diag, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out,
        HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_N, False, SOFTCAP, WINDOW, DOT_PRECISION, KV_TMA,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, K_BASE, V_BASE, K_DESC, V_DESC, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, full_hi, hi, n_q, n_k, diag, WIN_L, WIN_R, qk_scale, softcap_in, softcap_out,
        HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_N, True, SOFTCAP, WINDOW, DOT_PRECISION, KV_TMA,
    )

    # A row that saw no key: output 0, logsumexp -inf.
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))  # natural log
    O_BLOCK = tile_ptr(
        O + b * stride_ob + h * stride_oh + q_start * stride_ot, n_q, stride_ot, stride_od, q0, HEAD_DIM, BLOCK_M,
        BLOCK_D,
    )
    store_tile(O_BLOCK, acc.to(O.dtype.element_ty))
    tl.store(L + b * stride_lb + h * stride_lh + q_start + offs_m, lse, mask=offs_m < n_q)


def flash_forward_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: Params
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, Hq, Tq, d) in the input dtype and layout (:func:`~cs336_kernels.ops._common.output_like`) and
    logsumexp (B, Hq, Tq) in fp32, from (B, H, T, d) tensors with a unit stride on d. A packed batch comes as
    (1, H, total, d) views of its (total, H, d) tensors, its sequences in ``params``."""
    batch, heads_q, n_queries, head_dim = q.shape
    heads_kv, n_keys = k.shape[1], k.shape[2]
    o = output_like(q)
    lse = torch.empty((batch, heads_q, n_queries), device=q.device, dtype=torch.float32)
    geometry = launch_geometry(params, q, k)

    def grid(meta):
        return (triton.cdiv(geometry.rows_q, meta["BLOCK_M"]), geometry.n_seqs * heads_q)

    def launch() -> None:
        _attn_fwd_kernel[grid](
            q, k, v, o, lse, params.cu_seqlens_q, params.cu_seqlens_k,
            *(s for t in (q, k, v, o) for s in geometry.strides(t)), *geometry.strides(lse)[:2],
            heads_q, heads_q // heads_kv, **params.kernel_args(n_queries, n_keys), **kernel_constants(q, params),
        )

    with_tma_scratch(launch)
    return o, lse
