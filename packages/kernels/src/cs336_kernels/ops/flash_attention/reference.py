"""FlashAttention-2 in plain PyTorch: a float64-able reference, the tiled forward, the recomputation backward.

- :func:`attention_reference` materialises the (queries x keys) scores: the oracle of the tests (pass
  float64 tensors) and of the benchmarks, with every knob of the kernels; :func:`attention_reference_varlen` runs
  it on each sequence of a packed batch.
- :func:`flash_forward_pytorch` is Algorithm 1 of FlashAttention-2, one (query tile, key tile) pair at
  a time with the online softmax the Triton forward uses.
- :func:`flash_backward_pytorch` recomputes ``P = exp(S - L)`` from the saved logsumexp and uses
  ``D = rowsum(dO * O)``; :func:`flash_backward_compiled` is it under ``torch.compile``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from cs336_kernels.ops.flash_attention.params import Params


def as_4d(x: torch.Tensor) -> torch.Tensor:
    """(B, T, d) -> (B, 1, T, d); (B, H, T, d) as is. A view, so results reshape back with ``.view(x.shape)``."""
    return x.unsqueeze(1) if x.dim() == 3 else x


def _causal_keep(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """(Tq, Tk) boolean, True where query i may see key j (top-left aligned: j <= i)."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril()


def visible_keys(n_queries: int, n_keys: int, window_size: tuple[int, int], bottom_right: bool,
                 device: torch.device) -> torch.Tensor:
    """(Tq, Tk) boolean, True where query i sees key j: ``diagonal - left <= j <= diagonal + right`` with
    ``diagonal = i + Tk - Tq`` (bottom-right) or ``i`` (top-left), a side of -1 unbounded."""
    left, right = window_size
    rel = torch.arange(n_keys, device=device)[None, :] - torch.arange(n_queries, device=device)[:, None]
    if bottom_right:
        rel = rel - (n_keys - n_queries)
    keep = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= rel >= -left
    if right >= 0:
        keep &= rel <= right
    return keep


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    # (B, Hq, T, d) -> (B, Hkv, G, T, d): query heads of one group sit next to each other.
    batch, heads_q = q.shape[:2]
    return q.reshape(batch, num_kv_heads, heads_q // num_kv_heads, *q.shape[2:])


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
    softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    bottom_right: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialised attention and its logsumexp, in the inputs' dtype; for tests (pass float64).

    Takes (B, T, d) or (B, H, T, d) with GQA and the knobs of :func:`flash_attention` (``bottom_right=False``:
    the course's top-left causal alignment). A query that sees no key gets a zero output and a logsumexp of -inf.
    Returns ``(O, L)`` with ``O`` shaped like ``q`` and ``L`` like ``q.shape[:-1]``.
    """
    q4, k4, v4 = as_4d(q), as_4d(k), as_4d(v)
    heads_kv = k4.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    qg = _grouped(q4, heads_kv)  # (B, Hkv, G, Tq, d)
    s = qg @ k4.unsqueeze(2).transpose(-2, -1) * scale  # (B, Hkv, G, Tq, Tk)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    left, right = window_size
    keep = visible_keys(s.shape[-2], s.shape[-1], (left, 0 if is_causal else right), bottom_right, s.device)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1).masked_fill(lse.unsqueeze(-1) == float("-inf"), 0.0))
    o = p @ v4.unsqueeze(2)
    return o.reshape(q.shape), lse.reshape(q.shape[:-1])


def attention_reference_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    causal: bool = False, **knobs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_reference` of a packed batch (q (total_q, Hq, d), k and v (total_k, Hkv, d), int32
    cumulative lengths), one sequence at a time: ``(O (total_q, Hq, d), L (Hq, total_q))``. ``knobs`` are
    :func:`attention_reference`'s keywords."""
    outs, lses = [], []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        (q0, q1), (k0, k1) = bounds_q[b:b + 2], bounds_k[b:b + 2]
        if q1 == q0:
            continue
        if k1 == k0:  # no key: zero output, -inf logsumexp
            outs.append(q.new_zeros(q1 - q0, *q.shape[1:]))
            lses.append(q.new_full((q.shape[1], q1 - q0), float("-inf")))
            continue
        seq = (t[a:z].transpose(0, 1).unsqueeze(0) for t, a, z in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        o, lse = attention_reference(*seq, causal, **knobs)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


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
    lse: torch.Tensor, is_causal: bool, scale: float | None = None, dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equations 13-19 of the handout: recompute ``P = exp(S - L)``, use ``D = rowsum(dO * O)``.

    Takes (B, H, T, d) tensors, the (B, Hq, Tq) logsumexp and (optionally) its gradient ``dlse`` and the scores'
    scale (default ``1 / sqrt(d)``); causal is top-left aligned; computes in fp32 and returns gradients in the
    input dtypes. It materialises one (Tq, Tk) tile per head, so it is meant for modest lengths.
    """
    heads_kv = k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qg, og, dog = (_grouped(t, heads_kv).float() for t in (q, o, do))  # (B, Hkv, G, Tq, d)
    kf, vf = k.unsqueeze(2).float(), v.unsqueeze(2).float()  # (B, Hkv, 1, Tk, d)
    s = qg @ kf.transpose(-2, -1) * scale  # (B, Hkv, G, Tq, Tk)
    p = torch.exp(s - _grouped(lse.unsqueeze(-1), heads_kv))
    if is_causal:
        p = p.masked_fill(~_causal_keep(s.shape[-2], s.shape[-1], s.device), 0.0)
    delta = (dog * og).sum(dim=-1, keepdim=True)  # D
    if dlse is not None:
        delta = delta - _grouped(dlse.unsqueeze(-1), heads_kv)  # dL/dS = P joins dS = P * (dP - D)
    dv = (p.transpose(-2, -1) @ dog).sum(dim=2)  # summed over the query heads of a group
    dp = dog @ vf.transpose(-2, -1)
    ds = p * (dp - delta)
    dq = ds @ kf * scale
    dk = (ds.transpose(-2, -1) @ qg).sum(dim=2) * scale
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@functools.cache
def _compiled_backward() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    # Built on first use: torch.compile imports the inductor, which would slow every import of cs336_kernels.
    # dynamic=True: one compiled graph serves every length instead of recompiling per shape.
    return torch.compile(flash_backward_pytorch, dynamic=True)


def flash_backward_compiled(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
    lse: torch.Tensor, is_causal: bool, scale: float | None = None, dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`flash_backward_pytorch` under ``torch.compile``."""
    return _compiled_backward()(q, k, v, o, do, lse, is_causal, scale, dlse)


def pytorch_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, params: Params,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The operators' ``backward="pytorch"``: :func:`flash_backward_compiled` for what it runs, plain causal or
    full attention of a dense batch (the public functions refuse the rest before they reach here)."""
    return flash_backward_compiled(q, k, v, o, do, lse, params.window_right == 0, params.softmax_scale, dlse)
