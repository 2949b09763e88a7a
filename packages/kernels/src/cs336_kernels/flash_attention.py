"""FlashAttention-2 (Dao, 2023) in Triton, with a tiled pure-PyTorch twin and a float64 reference.

Attention ``softmax(Q K^T / sqrt(d)) V`` is computed one query tile at a time with an online softmax
(Milakov & Gimelshein, 2018): a running row maximum ``m`` and denominator ``l`` let each key tile be
folded into an fp32 accumulator without ever writing the (queries x keys) score matrix to memory. The
forward pass saves only the output ``O`` and the row logsumexp ``L``; the backward pass recomputes the
probabilities ``P = exp(S - L)`` tile by tile and uses ``D = rowsum(dO * O)`` in place of the softmax
Jacobian.

Read top to bottom: Triton kernels (forward, ``D`` preprocessing, dK/dV over key tiles, dQ over query
tiles), their launch functions, the pure-PyTorch pieces (reference, tiled forward, compiled backward),
the two ``torch.autograd.Function`` classes and the public :func:`flash_attention`.

Conventions:
- Shapes are (batch, seq, d) or (batch, heads, seq, d). Keys and values may have fewer heads than
  queries (grouped-query attention): query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
- Causal masking with ``Tq != Tk`` is aligned top-left, as in ``torch.nn.functional.
  scaled_dot_product_attention(is_causal=True)``: query ``i`` sees keys ``0..i``. Every query therefore
  sees at least key 0, so no row is ever empty; keys past ``Tq - 1`` get zero gradient.
- ``L`` is the natural-log logsumexp of the scaled scores, fp32, shaped like ``Q`` without its last dim.
- Causal tile skipping: key tiles wholly above the diagonal are never loaded, tiles that straddle it
  are masked element-wise, all others run unmasked. Heavier query tiles are launched first.
- The Triton backward pass is two kernels without atomics, so it is deterministic: one program per key
  tile accumulates dK and dV over every query tile (and every query head of its group), one program per
  query tile accumulates dQ over every key tile. S and dP are computed in both, so the backward runs
  seven matmuls per tile pair instead of five; dQ by atomics inside the dK/dV kernel (five matmuls) was
  measured slower on an H200 with per-element and with TMA reductions (writeup/results/attention_notes.md).
- fp32 inputs use true fp32 products (``input_precision="ieee"``), not TF32.

Run the tests with ``uv run pytest packages/kernels/tests/test_flash_attention.py`` (on CPU they use
the Triton interpreter) and the benchmarks with ``cs336 attention --help``.
"""

from __future__ import annotations

import contextvars
import math
import os
from typing import Literal

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BackwardImpl = Literal["triton", "pytorch"]

# The interpreter executes every program in numpy: tiny tiles and no autotuning keep the CPU tests fast.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ----------------------------------------------------------------------------------------------------
# Autotuning: a short list per regime, picked by dtype width and padded head dim before any benchmarking.
# ----------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages), keyed by (bytes per element, padded head dim). 16-bit d = 64
# and d = 128: the two fastest of a wider sweep on an H200 (cs336_harness.attention_tuning, rows in
# writeup/results/attention_tuning.jsonl); other entries were chosen from sm_90 builds with few register
# spills. fp32 runs on FMA units, not tensor cores, and needs far smaller tiles. BLOCK_M counts queries and
# BLOCK_N keys in every kernel; the forward and dQ kernels loop over key tiles and need BLOCK_N | BLOCK_M,
# the dK/dV kernel loops over query tiles and needs BLOCK_M | BLOCK_N.
_FWD_TABLE = {
    (2, 16): [(128, 64, 4, 3), (128, 128, 8, 3)],
    (2, 32): [(128, 64, 4, 3), (128, 128, 8, 3)],
    (2, 64): [(64, 64, 4, 3), (128, 64, 4, 4)],
    (2, 128): [(128, 128, 8, 3), (128, 64, 8, 3)],
    (2, 256): [(64, 64, 8, 2), (128, 32, 8, 2)],
    (4, 16): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (4, 32): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (4, 64): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (4, 128): [(32, 16, 8, 2), (16, 16, 4, 2)],
    (4, 256): [(16, 16, 8, 1), (16, 16, 4, 1)],
}
_DKDV_TABLE = {
    (2, 16): [(64, 128, 8, 3), (64, 64, 4, 3)],
    (2, 32): [(64, 128, 8, 3), (64, 64, 4, 3)],
    (2, 64): [(64, 64, 4, 3), (64, 128, 8, 3)],
    (2, 128): [(32, 128, 8, 3), (64, 128, 8, 2)],
    (2, 256): [(16, 64, 8, 2), (32, 32, 8, 2)],
    (4, 16): [(32, 32, 8, 2), (16, 32, 4, 2)],
    (4, 32): [(32, 32, 8, 2), (16, 32, 4, 2)],
    (4, 64): [(32, 32, 8, 2), (16, 32, 4, 2)],
    (4, 128): [(16, 32, 8, 2), (16, 16, 4, 2)],
    (4, 256): [(16, 16, 8, 1), (16, 16, 4, 1)],
}
_DQ_TABLE = {
    (2, 16): [(128, 64, 8, 3), (128, 128, 8, 2)],
    (2, 32): [(128, 64, 8, 3), (128, 128, 8, 2)],
    (2, 64): [(64, 64, 4, 4), (128, 128, 8, 3)],
    (2, 128): [(128, 64, 8, 3), (128, 32, 8, 3)],
    (2, 256): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (4, 16): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (4, 32): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (4, 64): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (4, 128): [(32, 16, 8, 2), (16, 16, 4, 2)],
    (4, 256): [(16, 16, 8, 1), (16, 16, 4, 1)],
}
# Forward: the two listed tiles per 16-bit regime again, with K and V loaded by TMA (device-side tensor
# descriptors, KV_TMA=True), so that the autotuner times both load paths on the GPU. sm_90 builds: same HGMMA
# count, no spills, fewer registers; on an H200 the autotuner picked a TMA config at both anchor shapes, the
# 32k forward 15.7 instead of 16.9 ms (writeup/results/attention_notes.md, 2026-11-30).
_FWD_TMA_TABLE = {
    (2, 64): [(64, 64, 4, 3), (128, 64, 4, 4)],
    (2, 128): [(128, 128, 8, 3), (128, 64, 8, 3)],
}
# Backward: the listed tiles again with the tiles each kernel re-reads in its main loop loaded by TMA, Q and dO in
# the dK/dV kernel (QDO_TMA=True), K and V in the dQ kernel (KV_TMA=True). Each one's sm_90 build has UTMALDG,
# the same HGMMA count and fewer registers or spills, e.g. dK/dV at d = 128 (64, 128, 8, 2): 233 -> 61 spill
# stores. On an H200 the autotuner picked the TMA config of both kernels at both anchor shapes; at the 32k one
# dK/dV 35.31 -> 34.77 ms and dQ 21.25 -> 20.32 ms (writeup/results/attention_notes.md, 2026-11-30).
_DKDV_TMA_TABLE = {
    (2, 64): [(64, 64, 4, 3), (64, 128, 8, 3)],
    (2, 128): [(64, 128, 8, 2), (32, 128, 8, 3)],
}
_DQ_TMA_TABLE = {
    (2, 64): [(64, 64, 4, 4), (128, 128, 8, 3)],
    (2, 128): [(128, 64, 8, 3), (128, 32, 8, 3)],
}
_INTERPRETER_CONFIG = (16, 16, 1, 1)
# Per kernel: its table, its TMA table, the constexpr that switches its main-loop loads to TMA, and the tensors
# (with their stride prefixes) that those loads read.
_TABLES = {
    "fwd": (_FWD_TABLE, _FWD_TMA_TABLE), "dkdv": (_DKDV_TABLE, _DKDV_TMA_TABLE), "dq": (_DQ_TABLE, _DQ_TMA_TABLE)
}
_TMA_FLAGS = {"fwd": "KV_TMA", "dkdv": "QDO_TMA", "dq": "KV_TMA"}
_TMA_TENSORS = {"fwd": {"K": "k", "V": "v"}, "dkdv": {"Q": "q", "DO": "do"}, "dq": {"K": "k", "V": "v"}}


def _configs(kernel: str) -> list[triton.Config]:
    """One config per distinct entry of ``kernel``'s tables; those of its TMA table also set its TMA flag."""
    table, tma_table = _TABLES[kernel]
    if _INTERPRET:
        entries = {(*_INTERPRETER_CONFIG, False)}
    else:
        entries = {(*entry, False) for entries in table.values() for entry in entries}
        entries |= {(*entry, True) for entries in tma_table.values() for entry in entries}
    flag = _TMA_FLAGS[kernel]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n} | ({flag: True} if tma else {}), num_warps=w, num_stages=s)
        for m, n, w, s, tma in sorted(entries)
    ]


def _tma_ok(named_args: dict, tensors: dict[str, str]) -> bool:
    # A tensor descriptor needs a Hopper-or-newer GPU, a 16-byte-aligned base for every (batch, head) and
    # positive 16-byte row strides (TMA's rules; an upstream expand can leave dO with row stride 0); the d
    # stride is already 1 here.
    loaded = [named_args[name] for name in tensors]
    if not loaded[0].is_cuda or torch.cuda.get_device_capability(loaded[0].device)[0] < 9:
        return False
    strides = [named_args[f"stride_{prefix}{axis}"] for prefix in tensors.values() for axis in "bht"]
    rows_ok = all(named_args[f"stride_{prefix}t"] > 0 for prefix in tensors.values())
    return rows_ok and all(t.data_ptr() % 16 == 0 for t in loaded) and all(
        s * loaded[0].element_size() % 16 == 0 for s in strides
    )


def _pruner(kernel: str):
    # Holds the tables themselves, not copies: attention_tuning.widen() edits them in place.
    table, tma_table = _TABLES[kernel]
    flag = _TMA_FLAGS[kernel]

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        key = (named_args["Q"].element_size(), kwargs["BLOCK_D"])
        wanted = {(*entry, False) for entry in table[key]}
        if _tma_ok(named_args, _TMA_TENSORS[kernel]):
            wanted |= {(*entry, True) for entry in tma_table.get(key, [])}
        return [
            c for c in configs
            if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.kwargs.get(flag, False))
            in wanted
        ]

    return {"early_config_prune": prune}


def _tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # Global memory in which each program of a TMA config writes its tensor descriptors.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _with_tma_scratch(launch) -> None:
    # TMA configs need scratch memory for their descriptors; the allocator is set in a copy of the caller's
    # context so that an allocator the caller installed stays in place.
    def run() -> None:
        triton.set_allocator(_tma_scratch)
        launch()

    contextvars.copy_context().run(run)


def _quick_bench(fn, quantiles=None):
    # Autotuning runs once per new shape; a short measurement keeps a cold sweep over many shapes fast.
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_AUTOTUNE_KEY = ["N_QUERIES", "N_KEYS", "HEAD_DIM", "IS_CAUSAL"]


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(block_ptr, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
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
def _tma_descriptors(
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
def _load_tiles(A_BLOCK, B_BLOCK, A_DESC, B_DESC, start, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr,
                USE_TMA: tl.constexpr):
    # The two tiles a main loop reads at row `start`: by TMA (no bounds checks needed), or by block pointers.
    if USE_TMA:
        a = A_DESC.load([start, 0])
        b = B_DESC.load([start, 0])
    else:
        a = _load_tile(A_BLOCK, CHECK_ROWS, EVEN_D)
        b = _load_tile(B_BLOCK, CHECK_ROWS, EVEN_D)
    return a, b


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, K_BASE, V_BASE, K_DESC, V_DESC,
    stride_kt, stride_kd, stride_vt, stride_vd,
    offs_m, lo, hi, N_KEYS, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_TMA: tl.constexpr,
):
    K_BLOCK = tl.make_block_ptr(
        K_BASE, shape=(N_KEYS, HEAD_DIM), strides=(stride_kt, stride_kd),
        offsets=(lo, 0), block_shape=(BLOCK_N, BLOCK_D), order=(1, 0),
    )
    V_BLOCK = tl.make_block_ptr(
        V_BASE, shape=(N_KEYS, HEAD_DIM), strides=(stride_vt, stride_vd),
        offsets=(lo, 0), block_shape=(BLOCK_N, BLOCK_D), order=(1, 0),
    )
    for start in range(lo, hi, BLOCK_N):
        k, v = _load_tiles(K_BLOCK, V_BLOCK, K_DESC, V_DESC, start, MASKED, EVEN_D, KV_TMA)
        # Scores in log2 units (scale * log2(e) folded in) so the exponentials are exp2. Unmasked tiles
        # take the row max of the raw scores (the scale is positive) and fold the scaling into the
        # subtraction, one FMA per score instead of a multiply and a subtract.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if MASKED:
            offs_n = start + tl.arange(0, BLOCK_N)
            keep = offs_n[None, :] < N_KEYS
            if IS_CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
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


@triton.autotune(
    configs=_configs("fwd"), key=_AUTOTUNE_KEY, prune_configs_by=_pruner("fwd"), do_bench=_quick_bench,
)
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

    Q_BLOCK = tl.make_block_ptr(
        Q + b * stride_qb + h * stride_qh, shape=(N_QUERIES, HEAD_DIM), strides=(stride_qt, stride_qd),
        offsets=(q0, 0), block_shape=(BLOCK_M, BLOCK_D), order=(1, 0),
    )
    q = _load_tile(Q_BLOCK, True, EVEN_D)
    offs_m = q0 + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Key tiles [0, full_end) are complete and (if causal) wholly below the diagonal: no mask. Tiles in
    # [full_end, hi) straddle the diagonal or the end of the keys: masked. Tiles past hi are skipped.
    k_full = (N_KEYS // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        full_end = tl.minimum(q0, k_full)
        hi = tl.minimum(q0 + BLOCK_M, N_KEYS)
    else:
        full_end = k_full
        hi = N_KEYS
    K_BASE = K + b * stride_kb + h_kv * stride_kh
    V_BASE = V + b * stride_vb + h_kv * stride_vh
    if KV_TMA:
        # One descriptor per head for both key loops (sm_90 builds: 231 instead of 254 registers at d = 128).
        K_DESC, V_DESC = _tma_descriptors(K_BASE, V_BASE, stride_kt, stride_vt, N_KEYS, HEAD_DIM, BLOCK_N, BLOCK_D)
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
    O_BLOCK = tl.make_block_ptr(
        O + b * stride_ob + h * stride_oh, shape=(N_QUERIES, HEAD_DIM), strides=(stride_ot, stride_od),
        offsets=(q0, 0), block_shape=(BLOCK_M, BLOCK_D), order=(1, 0),
    )
    tl.store(O_BLOCK, acc.to(O.dtype.element_ty), boundary_check=(0, 1))
    tl.store(L + b * stride_lb + h * stride_lh + offs_m, lse, mask=offs_m < N_QUERIES)


@triton.jit
def _bwd_preprocess_kernel(
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
    offs_n, lo, hi, N_QUERIES, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
    CHECK_ROWS: tl.constexpr, CAUSAL_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, QDO_TMA: tl.constexpr,
):
    Q_BLOCK = tl.make_block_ptr(
        Q_BASE, shape=(N_QUERIES, HEAD_DIM), strides=(stride_qt, stride_qd),
        offsets=(lo, 0), block_shape=(BLOCK_M, BLOCK_D), order=(1, 0),
    )
    DO_BLOCK = tl.make_block_ptr(
        DO_BASE, shape=(N_QUERIES, HEAD_DIM), strides=(stride_dot, stride_dod),
        offsets=(lo, 0), block_shape=(BLOCK_M, BLOCK_D), order=(1, 0),
    )
    for start in range(lo, hi, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        q, do = _load_tiles(Q_BLOCK, DO_BLOCK, Q_DESC, DO_DESC, start, CHECK_ROWS, EVEN_D, QDO_TMA)
        if CHECK_ROWS:
            # Padded query rows get L = +inf, hence P = 0: they add nothing to dK or dV.
            lse = tl.load(L_BASE + offs_m, mask=offs_m < N_QUERIES, other=float("inf"))
            delta = tl.load(DELTA_BASE + offs_m, mask=offs_m < N_QUERIES, other=0.0)
        else:
            lse = tl.load(L_BASE + offs_m)
            delta = tl.load(DELTA_BASE + offs_m)
        # Work with transposed tiles (keys x queries) so that no probability tile needs transposing.
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        p_t = tl.exp2(s_t * qk_scale - (lse * 1.4426950408889634)[None, :])
        if CAUSAL_MASK:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, acc=dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, acc=dk, input_precision=DOT_PRECISION)
        Q_BLOCK = tl.advance(Q_BLOCK, (BLOCK_M, 0))
        DO_BLOCK = tl.advance(DO_BLOCK, (BLOCK_M, 0))
    return dk, dv


@triton.autotune(
    configs=_configs("dkdv"), key=_AUTOTUNE_KEY, prune_configs_by=_pruner("dkdv"), do_bench=_quick_bench,
)
@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, L, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_lb, stride_lh,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dvd,
    H_KV, GROUP, N_QUERIES, N_KEYS, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QDO_TMA: tl.constexpr = False,
):
    # Grid: (key tiles, batch * key/value heads). Each program owns its dK, dV tile: no atomics needed,
    # and a GQA group's query heads are summed here in a fixed order, so dK and dV are deterministic.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    h_kv = (pid_bh % H_KV).to(tl.int64)
    k0 = pid_n * BLOCK_N
    offs_n = k0 + tl.arange(0, BLOCK_N)

    K_BLOCK = tl.make_block_ptr(
        K + b * stride_kb + h_kv * stride_kh, shape=(N_KEYS, HEAD_DIM), strides=(stride_kt, stride_kd),
        offsets=(k0, 0), block_shape=(BLOCK_N, BLOCK_D), order=(1, 0),
    )
    V_BLOCK = tl.make_block_ptr(
        V + b * stride_vb + h_kv * stride_vh, shape=(N_KEYS, HEAD_DIM), strides=(stride_vt, stride_vd),
        offsets=(k0, 0), block_shape=(BLOCK_N, BLOCK_D), order=(1, 0),
    )
    k = _load_tile(K_BLOCK, True, EVEN_D)
    v = _load_tile(V_BLOCK, True, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query tiles: [k0, k0 + BLOCK_N) straddle the diagonal (causal only; masked); [lo_full, q_full) are
    # complete and unmasked; [q_full, N_QUERIES) is the partial last tile. Tiles above k0 are skipped.
    q_full = (N_QUERIES // BLOCK_M) * BLOCK_M
    lo_full = k0 + BLOCK_N if IS_CAUSAL else 0
    lo_tail = tl.maximum(lo_full, q_full)
    for g in range(GROUP):
        h = h_kv * GROUP + g
        Q_BASE = Q + b * stride_qb + h * stride_qh
        DO_BASE = DO + b * stride_dob + h * stride_doh
        L_BASE = L + b * stride_lb + h * stride_lh
        DELTA_BASE = DELTA + b * stride_lb + h * stride_lh
        if QDO_TMA:
            # One descriptor per query head for its three query loops.
            Q_DESC, DO_DESC = _tma_descriptors(
                Q_BASE, DO_BASE, stride_qt, stride_dot, N_QUERIES, HEAD_DIM, BLOCK_M, BLOCK_D
            )
        else:
            Q_DESC, DO_DESC = None, None
        if IS_CAUSAL:
            dk, dv = _dkdv_inner(
                dk, dv, k, v, Q_BASE, DO_BASE, Q_DESC, DO_DESC, L_BASE, DELTA_BASE,
                stride_qt, stride_qd, stride_dot, stride_dod,
                offs_n, k0, tl.minimum(k0 + BLOCK_N, N_QUERIES), N_QUERIES, qk_scale,
                HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_M, True, True, DOT_PRECISION, QDO_TMA,
            )
        dk, dv = _dkdv_inner(
            dk, dv, k, v, Q_BASE, DO_BASE, Q_DESC, DO_DESC, L_BASE, DELTA_BASE,
            stride_qt, stride_qd, stride_dot, stride_dod,
            offs_n, lo_full, q_full, N_QUERIES, qk_scale,
            HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_M, False, False, DOT_PRECISION, QDO_TMA,
        )
        dk, dv = _dkdv_inner(
            dk, dv, k, v, Q_BASE, DO_BASE, Q_DESC, DO_DESC, L_BASE, DELTA_BASE,
            stride_qt, stride_qd, stride_dot, stride_dod,
            offs_n, lo_tail, N_QUERIES, N_QUERIES, qk_scale,
            HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_M, True, False, DOT_PRECISION, QDO_TMA,
        )

    dk = dk * sm_scale
    DK_BLOCK = tl.make_block_ptr(
        DK + b * stride_dkb + h_kv * stride_dkh, shape=(N_KEYS, HEAD_DIM), strides=(stride_dkt, stride_dkd),
        offsets=(k0, 0), block_shape=(BLOCK_N, BLOCK_D), order=(1, 0),
    )
    DV_BLOCK = tl.make_block_ptr(
        DV + b * stride_dvb + h_kv * stride_dvh, shape=(N_KEYS, HEAD_DIM), strides=(stride_dvt, stride_dvd),
        offsets=(k0, 0), block_shape=(BLOCK_N, BLOCK_D), order=(1, 0),
    )
    tl.store(DK_BLOCK, dk.to(DK.dtype.element_ty), boundary_check=(0, 1))
    tl.store(DV_BLOCK, dv.to(DV.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _dq_inner(
    dq, q, do, lse2, delta, K_BASE, V_BASE, K_DESC, V_DESC,
    stride_kt, stride_kd, stride_vt, stride_vd,
    offs_m, lo, hi, N_KEYS, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_TMA: tl.constexpr,
):
    K_BLOCK = tl.make_block_ptr(
        K_BASE, shape=(N_KEYS, HEAD_DIM), strides=(stride_kt, stride_kd),
        offsets=(lo, 0), block_shape=(BLOCK_N, BLOCK_D), order=(1, 0),
    )
    V_BLOCK = tl.make_block_ptr(
        V_BASE, shape=(N_KEYS, HEAD_DIM), strides=(stride_vt, stride_vd),
        offsets=(lo, 0), block_shape=(BLOCK_N, BLOCK_D), order=(1, 0),
    )
    for start in range(lo, hi, BLOCK_N):
        k, v = _load_tiles(K_BLOCK, V_BLOCK, K_DESC, V_DESC, start, MASKED, EVEN_D, KV_TMA)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            offs_n = start + tl.arange(0, BLOCK_N)
            keep = offs_n[None, :] < N_KEYS
            if IS_CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, acc=dq, input_precision=DOT_PRECISION)
        K_BLOCK = tl.advance(K_BLOCK, (BLOCK_N, 0))
        V_BLOCK = tl.advance(V_BLOCK, (BLOCK_N, 0))
    return dq


@triton.autotune(
    configs=_configs("dq"), key=_AUTOTUNE_KEY, prune_configs_by=_pruner("dq"), do_bench=_quick_bench
)
@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, L, DELTA, DQ,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    H_Q, GROUP, N_QUERIES, N_KEYS, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_TMA: tl.constexpr = False,
):
    # Grid: (query tiles, batch * query heads); the same tile walk as the forward pass.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0) if IS_CAUSAL else tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_Q).to(tl.int64)
    h = (pid_bh % H_Q).to(tl.int64)
    h_kv = h // GROUP
    q0 = pid_m * BLOCK_M
    offs_m = q0 + tl.arange(0, BLOCK_M)

    Q_BLOCK = tl.make_block_ptr(
        Q + b * stride_qb + h * stride_qh, shape=(N_QUERIES, HEAD_DIM), strides=(stride_qt, stride_qd),
        offsets=(q0, 0), block_shape=(BLOCK_M, BLOCK_D), order=(1, 0),
    )
    DO_BLOCK = tl.make_block_ptr(
        DO + b * stride_dob + h * stride_doh, shape=(N_QUERIES, HEAD_DIM), strides=(stride_dot, stride_dod),
        offsets=(q0, 0), block_shape=(BLOCK_M, BLOCK_D), order=(1, 0),
    )
    q = _load_tile(Q_BLOCK, True, EVEN_D)
    do = _load_tile(DO_BLOCK, True, EVEN_D)
    row_ok = offs_m < N_QUERIES
    lse = tl.load(L + b * stride_lb + h * stride_lh + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + b * stride_lb + h * stride_lh + offs_m, mask=row_ok, other=0.0)
    lse2 = lse * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_full = (N_KEYS // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        full_end = tl.minimum(q0, k_full)
        hi = tl.minimum(q0 + BLOCK_M, N_KEYS)
    else:
        full_end = k_full
        hi = N_KEYS
    K_BASE = K + b * stride_kb + h_kv * stride_kh
    V_BASE = V + b * stride_vb + h_kv * stride_vh
    if KV_TMA:
        K_DESC, V_DESC = _tma_descriptors(K_BASE, V_BASE, stride_kt, stride_vt, N_KEYS, HEAD_DIM, BLOCK_N, BLOCK_D)
    else:
        K_DESC, V_DESC = None, None
    dq = _dq_inner(
        dq, q, do, lse2, delta, K_BASE, V_BASE, K_DESC, V_DESC, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, 0, full_end, N_KEYS, qk_scale,
        HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_N, False, IS_CAUSAL, DOT_PRECISION, KV_TMA,
    )
    dq = _dq_inner(
        dq, q, do, lse2, delta, K_BASE, V_BASE, K_DESC, V_DESC, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, full_end, hi, N_KEYS, qk_scale,
        HEAD_DIM, BLOCK_D, EVEN_D, BLOCK_N, True, IS_CAUSAL, DOT_PRECISION, KV_TMA,
    )
    dq = dq * sm_scale
    DQ_BLOCK = tl.make_block_ptr(
        DQ + b * stride_dqb + h * stride_dqh, shape=(N_QUERIES, HEAD_DIM), strides=(stride_dqt, stride_dqd),
        offsets=(q0, 0), block_shape=(BLOCK_M, BLOCK_D), order=(1, 0),
    )
    tl.store(DQ_BLOCK, dq.to(DQ.dtype.element_ty), boundary_check=(0, 1))


# ----------------------------------------------------------------------------------------------------
# Launch functions: all tensors are (batch, heads, seq, d) here, with a unit stride on d.
# ----------------------------------------------------------------------------------------------------


def _kernel_constants(q: torch.Tensor, is_causal: bool) -> dict:
    head_dim = q.shape[-1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    return {
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "EVEN_D": head_dim == block_d,
        "IS_CAUSAL": is_causal,
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


def flash_forward_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, Hq, Tq, d) in the input dtype and logsumexp (B, Hq, Tq) in fp32."""
    batch, heads_q, n_queries, head_dim = q.shape
    heads_kv, n_keys = k.shape[1], k.shape[2]
    o = torch.empty((batch, heads_q, n_queries, head_dim), device=q.device, dtype=q.dtype)
    lse = torch.empty((batch, heads_q, n_queries), device=q.device, dtype=torch.float32)
    sm_scale = 1.0 / math.sqrt(head_dim)

    def grid(meta):
        return (triton.cdiv(n_queries, meta["BLOCK_M"]), batch * heads_q)

    def launch() -> None:
        _attn_fwd_kernel[grid](
            q, k, v, o, lse,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), lse.stride(0), lse.stride(1),
            heads_q, heads_q // heads_kv, n_queries, n_keys, sm_scale * LOG2E,
            **_kernel_constants(q, is_causal),
        )

    _with_tma_scratch(launch)
    return o, lse


@torch.library.custom_op("cs336::flash_attention_forward", mutates_args=())
def flash_forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flash_forward_triton` as the operator ``torch.ops.cs336.flash_attention_forward``, so that tools
    working at the operator level see it: selective activation checkpointing can keep its outputs instead
    of running it again in the backward, and ``torch.compile`` treats it as one opaque op."""
    return flash_forward_triton(q, k, v, is_causal)


@flash_forward_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


def flash_backward_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
    lse: torch.Tensor, is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV in the input dtypes, from the saved logsumexp.

    Three launches (D, dK/dV, dQ), no atomics, bitwise reproducible; the dQ kernel recomputes S and dP,
    so seven matmuls per tile pair.
    """
    batch, heads_q, n_queries, head_dim = q.shape
    heads_kv, n_keys = k.shape[1], k.shape[2]
    constants = _kernel_constants(q, is_causal)
    sm_scale = 1.0 / math.sqrt(head_dim)

    delta = torch.empty_like(lse)
    preprocess_block = 64 if not _INTERPRET else 16
    _bwd_preprocess_kernel[(triton.cdiv(n_queries, preprocess_block), batch * heads_q)](
        o, do, delta, *o.stride(), *do.stride(), delta.stride(0), delta.stride(1), heads_q, n_queries,
        HEAD_DIM=head_dim, BLOCK_D=constants["BLOCK_D"], BLOCK_M=preprocess_block,
    )

    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    group = heads_q // heads_kv

    def dkdv_grid(meta):
        return (triton.cdiv(n_keys, meta["BLOCK_N"]), batch * heads_kv)

    def dq_grid(meta):
        return (triton.cdiv(n_queries, meta["BLOCK_M"]), batch * heads_q)

    def launch() -> None:
        _attn_bwd_dkdv_kernel[dkdv_grid](
            q, k, v, do, lse, delta, dk, dv,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), lse.stride(0), lse.stride(1),
            *dk.stride(), *dv.stride(),
            heads_kv, group, n_queries, n_keys, sm_scale * LOG2E, sm_scale,
            **constants,
        )
        _attn_bwd_dq_kernel[dq_grid](
            q, k, v, do, lse, delta, dq,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), lse.stride(0), lse.stride(1),
            *dq.stride(),
            heads_q, group, n_queries, n_keys, sm_scale * LOG2E, sm_scale,
            **constants,
        )

    _with_tma_scratch(launch)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------
# Pure PyTorch: float64-able reference, tiled forward, recomputation backward (run through torch.compile)
# ----------------------------------------------------------------------------------------------------


def _causal_keep(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """(Tq, Tk) boolean, True where query i may see key j (top-left aligned: j <= i)."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril()


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    # (B, Hq, T, d) -> (B, Hkv, G, T, d): query heads of one group sit next to each other.
    batch, heads_q = q.shape[:2]
    return q.reshape(batch, num_kv_heads, heads_q // num_kv_heads, *q.shape[2:])


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialised attention and its logsumexp, in the inputs' dtype; for tests (pass float64).

    Takes (B, T, d) or (B, H, T, d) with GQA, like :func:`flash_attention`.
    Returns ``(O, L)`` with ``O`` shaped like ``q`` and ``L`` like ``q.shape[:-1]``.
    """
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    heads_kv = k4.shape[1]
    qg = _grouped(q4, heads_kv)  # (B, Hkv, G, Tq, d)
    s = qg @ k4.unsqueeze(2).transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, Hkv, G, Tq, Tk)
    if is_causal:
        s = s.masked_fill(~_causal_keep(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.exp(s - lse.unsqueeze(-1)) @ v4.unsqueeze(2)
    return o.reshape(q.shape), lse.reshape(q.shape[:-1])


def flash_forward_pytorch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, tile_q: int = 32, tile_k: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 of FlashAttention-2 in PyTorch, one (query tile, key tile) pair at a time.

    Takes (B, H, T, d) tensors; returns the output in the input dtype and fp32 logsumexp (B, Hq, Tq).
    """
    batch, heads_q, n_queries, head_dim = q.shape
    heads_kv, n_keys = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim)
    qg = _grouped(q, heads_kv).float()  # (B, Hkv, G, Tq, d)
    kf, vf = k.unsqueeze(2).float(), v.unsqueeze(2).float()  # (B, Hkv, 1, Tk, d)
    o = torch.empty_like(qg)
    lse = torch.empty(qg.shape[:-1], device=q.device, dtype=torch.float32)
    for i0 in range(0, n_queries, tile_q):
        q_tile = qg[..., i0:i0 + tile_q, :]
        rows = torch.arange(i0, i0 + q_tile.shape[-2], device=q.device)
        m = torch.full(q_tile.shape[:-1], float("-inf"), device=q.device)
        l = torch.zeros(q_tile.shape[:-1], device=q.device)
        acc = torch.zeros_like(q_tile)
        # Causal: key tiles that start after this tile's last query are never touched.
        hi = min(n_keys, i0 + tile_q) if is_causal else n_keys
        for j0 in range(0, hi, tile_k):
            s = q_tile @ kf[..., j0:j0 + tile_k, :].transpose(-2, -1) * scale  # (..., bq, bk)
            if is_causal and j0 + tile_k > i0:
                cols = torch.arange(j0, j0 + s.shape[-1], device=q.device)
                s = s.masked_fill(rows[:, None] < cols[None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new.unsqueeze(-1))
            alpha = torch.exp(m - m_new)
            l = alpha * l + p.sum(dim=-1)
            acc = alpha.unsqueeze(-1) * acc + p @ vf[..., j0:j0 + tile_k, :]
            m = m_new
        o[..., i0:i0 + tile_q, :] = acc / l.unsqueeze(-1)
        lse[..., i0:i0 + tile_q] = m + torch.log(l)
    return o.reshape(q.shape).to(q.dtype), lse.reshape(batch, heads_q, n_queries)


def flash_backward_pytorch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
    lse: torch.Tensor, is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equations 13-19 of the handout: recompute ``P = exp(S - L)``, use ``D = rowsum(dO * O)``.

    Takes (B, H, T, d) tensors and the (B, Hq, Tq) logsumexp; computes in fp32 and returns gradients in
    the input dtypes. It materialises one (Tq, Tk) tile per head, so it is meant for modest lengths.
    """
    heads_kv = k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    qg, og, dog = (_grouped(t, heads_kv).float() for t in (q, o, do))  # (B, Hkv, G, Tq, d)
    kf, vf = k.unsqueeze(2).float(), v.unsqueeze(2).float()  # (B, Hkv, 1, Tk, d)
    s = qg @ kf.transpose(-2, -1) * scale  # (B, Hkv, G, Tq, Tk)
    p = torch.exp(s - _grouped(lse.unsqueeze(-1), heads_kv))
    if is_causal:
        p = p.masked_fill(~_causal_keep(s.shape[-2], s.shape[-1], s.device), 0.0)
    delta = (dog * og).sum(dim=-1, keepdim=True)  # D
    dv = (p.transpose(-2, -1) @ dog).sum(dim=2)  # summed over the query heads of a group
    dp = dog @ vf.transpose(-2, -1)
    ds = p * (dp - delta)
    dq = ds @ kf * scale
    dk = (ds.transpose(-2, -1) @ qg).sum(dim=2) * scale
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# dynamic=True: one compiled graph serves every length instead of recompiling per shape.
_flash_backward_compiled = torch.compile(flash_backward_pytorch, dynamic=True)


# ----------------------------------------------------------------------------------------------------
# Input checks and autograd Functions
# ----------------------------------------------------------------------------------------------------


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    # (B, T, d) -> (B, 1, T, d); a view, so gradients reshape back with .view(x.shape).
    return x.unsqueeze(1) if x.dim() == 3 else x


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    # The kernels take any strides, but a unit stride on d keeps their loads coalesced.
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            "q, k, v must all be (batch, seq, d) or all (batch, heads, seq, d); got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k, v must share one dtype among {SUPPORTED_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"q and k must agree on batch and head dim; got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.dim() == 4 and q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"the number of query heads ({q.shape[1]}) must be a multiple of the number of key/value "
            f"heads ({k.shape[1]})"
        )
    if not MIN_HEAD_DIM <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {q.shape[-1]}")
    if q.shape[-2] == 0 or k.shape[-2] == 0 or q.shape[0] == 0:
        raise ValueError(f"batch and sequence lengths must be positive; got {tuple(q.shape)}, {tuple(k.shape)}")


class FlashAttentionPytorch(torch.autograd.Function):
    """FlashAttention-2 with a tiled PyTorch forward and a compiled PyTorch recomputation backward."""

    @staticmethod
    def forward(ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        _check_inputs(Q, K, V, is_causal)
        o, lse = flash_forward_pytorch(_as_4d(Q), _as_4d(K), _as_4d(V), is_causal)
        o = o.view(Q.shape)
        ctx.save_for_backward(lse.view(Q.shape[:-1]), Q, K, V, o)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        lse, Q, K, V, O = ctx.saved_tensors
        q4 = _as_4d(Q)
        dq, dk, dv = _flash_backward_compiled(
            q4, _as_4d(K), _as_4d(V), _as_4d(O), _as_4d(dO), lse.view(q4.shape[:-1]), ctx.is_causal
        )
        return dq.view(Q.shape), dk.view(K.shape), dv.view(V.shape), None


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 with a Triton forward and a Triton (or compiled PyTorch) backward."""

    @staticmethod
    def forward(
        ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool = False,
        backward: BackwardImpl = "triton",
    ) -> torch.Tensor:
        _check_inputs(Q, K, V, is_causal)
        if backward not in ("triton", "pytorch"):
            raise ValueError(f"backward must be 'triton' or 'pytorch', got {backward!r}")
        if Q.device.type != "cuda" and not _INTERPRET:
            raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); got device {Q.device}")
        Q, K, V = _unit_stride(Q), _unit_stride(K), _unit_stride(V)
        o, lse = flash_forward_op(_as_4d(Q), _as_4d(K), _as_4d(V), is_causal)
        o = o.view(Q.shape)
        ctx.save_for_backward(lse.view(Q.shape[:-1]), Q, K, V, o)
        ctx.is_causal = is_causal
        ctx.backward_impl = backward
        return o

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        lse, Q, K, V, O = ctx.saved_tensors
        q4 = _as_4d(Q)
        args = (q4, _as_4d(K), _as_4d(V), _as_4d(O), _as_4d(_unit_stride(dO)), lse.view(q4.shape[:-1]), ctx.is_causal)
        backward = flash_backward_triton if ctx.backward_impl == "triton" else _flash_backward_compiled
        dq, dk, dv = backward(*args)
        return dq.view(Q.shape), dk.view(K.shape), dv.view(V.shape), None, None


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
    backward: BackwardImpl = "triton",
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) v`` without materialising the score matrix (Triton, differentiable).

    Args:
        q: (batch, seq_q, d) or (batch, heads_q, seq_q, d); fp16, bf16 or fp32; d in [16, 256].
        k, v: (batch, seq_k, d) or (batch, heads_kv, seq_k, d) with heads_q a multiple of heads_kv.
        is_causal: mask keys after the query, aligned top-left (query i sees keys 0..i).
        backward: "triton" (Triton kernels: separate dK/dV and dQ kernels, bitwise-reproducible
            gradients) or "pytorch" (compiled recomputation).

    Returns:
        The attention output, shaped and typed like ``q``.
    """
    return FlashAttentionTriton.apply(q, k, v, is_causal, backward)
