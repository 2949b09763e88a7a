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

import math

import torch
import triton
import triton.language as tl

from cs336_kernels.ops._common import LOG2E, output_like
from cs336_kernels.ops.flash_attention.tiles import (
    kernel_constants,
    key_mask,
    key_tile_ranges,
    load_tile,
    load_tiles,
    tile_ptr,
    tma_descriptors,
    with_tma_scratch,
)
from cs336_kernels.ops.flash_attention.tuning import autotune


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, K_BASE, V_BASE, K_DESC, V_DESC,
    stride_kt, stride_kd, stride_vt, stride_vd,
    offs_m, lo, hi, N_KEYS, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_TMA: tl.constexpr,
):
    K_BLOCK = tile_ptr(K_BASE, N_KEYS, stride_kt, stride_kd, lo, HEAD_DIM, BLOCK_N, BLOCK_D)
    V_BLOCK = tile_ptr(V_BASE, N_KEYS, stride_vt, stride_vd, lo, HEAD_DIM, BLOCK_N, BLOCK_D)
    for start in range(lo, hi, BLOCK_N):
        k, v = load_tiles(K_BLOCK, V_BLOCK, K_DESC, V_DESC, start, MASKED, EVEN_D, KV_TMA)
        # Scores in log2 units (scale * log2(e) folded in) so the exponentials are exp2. Unmasked tiles
        # take the row max of the raw scores (the scale is positive) and fold the scaling into the
        # subtraction, one FMA per score instead of a multiply and a subtract.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if MASKED:
            keep = key_mask(offs_m, start, N_KEYS, BLOCK_N, IS_CAUSAL)
            s = tl.where(keep, s * qk_scale, float("-inf"))
            # Key 0 is in the first tile visited and visible to every row, so m_new is finite from then on.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=DOT_PRECISION)
        m_i = m_new
        K_BLOCK = tl.advance(K_BLOCK, (BLOCK_N, 0))
        V_BLOCK = tl.advance(V_BLOCK, (BLOCK_N, 0))
    return acc, l_i, m_i


@autotune("fwd")
@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, L,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_lb, stride_lh,
    H_Q, GROUP, N_QUERIES, N_KEYS, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_TMA: tl.constexpr = False,
):
    # Grid: (query tiles, batch * query heads). Causal tiles near the end do the most work; start them first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0) if IS_CAUSAL else tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_Q).to(tl.int64)
    h = (pid_bh % H_Q).to(tl.int64)
    h_kv = h // GROUP
    q0 = pid_m * BLOCK_M

    Q_BLOCK = tile_ptr(
        Q + b * stride_qb + h * stride_qh, N_QUERIES, stride_qt, stride_qd, q0, HEAD_DIM, BLOCK_M, BLOCK_D
    )
    q = load_tile(Q_BLOCK, True, EVEN_D)
    offs_m = q0 + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full_end, hi = key_tile_ranges(q0, N_KEYS, BLOCK_M, BLOCK_N, IS_CAUSAL)
    K_BASE = K + b * stride_kb + h_kv * stride_kh
    V_BASE = V + b * stride_vb + h_kv * stride_vh
    if KV_TMA:
        # One descriptor per head for both key loops.
        K_DESC, V_DESC = tma_descriptors(K_BASE, V_BASE, stride_kt, stride_vt, N_KEYS, HEAD_DIM, BLOCK_N, BLOCK_D)
    else:
        K_DESC, V_DESC = None, None
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, K_BASE, V_BASE, K_DESC, V_DESC, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, 0, full_end, N_KEYS, qk_scale,
        HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_N, False, IS_CAUSAL, DOT_PRECISION, KV_TMA,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, K_BASE, V_BASE, K_DESC, V_DESC, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, full_end, hi, N_KEYS, qk_scale,
        HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_N, True, IS_CAUSAL, DOT_PRECISION, KV_TMA,
    )

    acc = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # back to natural-log units
    O_BLOCK = tile_ptr(
        O + b * stride_ob + h * stride_oh, N_QUERIES, stride_ot, stride_od, q0, HEAD_DIM, BLOCK_M, BLOCK_D
    )
    tl.store(O_BLOCK, acc.to(O.dtype.element_ty), boundary_check=(0, 1))
    tl.store(L + b * stride_lb + h * stride_lh + offs_m, lse, mask=offs_m < N_QUERIES)


def flash_forward_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, Hq, Tq, d) in the input dtype and layout (:func:`~cs336_kernels.ops._common.output_like`) and
    logsumexp (B, Hq, Tq) in fp32, from (B, H, T, d) tensors with a unit stride on d."""
    batch, heads_q, n_queries, head_dim = q.shape
    heads_kv, n_keys = k.shape[1], k.shape[2]
    o = output_like(q)
    lse = torch.empty((batch, heads_q, n_queries), device=q.device, dtype=torch.float32)
    sm_scale = 1.0 / math.sqrt(head_dim)

    def grid(meta):
        return (triton.cdiv(n_queries, meta["BLOCK_M"]), batch * heads_q)

    def launch() -> None:
        _attn_fwd_kernel[grid](
            q, k, v, o, lse,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), lse.stride(0), lse.stride(1),
            heads_q, heads_q // heads_kv, n_queries, n_keys, sm_scale * LOG2E,
            **kernel_constants(q, is_causal),
        )

    with_tma_scratch(launch)
    return o, lse
