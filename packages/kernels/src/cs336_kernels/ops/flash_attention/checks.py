"""Input checks every attention path shares (the Triton kernels and the Gluon ones): types, shapes, grouped-query
heads, devices, head dims."""

from __future__ import annotations

import torch

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> None:
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


def check_varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The checks of a packed batch: (total, heads, d) tensors as :func:`check_inputs` has them (heads, dtypes,
    devices, head dim) and int32 cumulative lengths of one batch for queries and keys. The lengths' values are
    not read: that would wait for the GPU."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            "q, k, v of a packed batch must be (total_tokens, heads, d); got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    # The dense checks on (1, heads, total, d) views: one batch of every token.
    check_inputs(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), False)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be a 1-D int32 tensor of batch + 1 >= 2 cumulative lengths; got "
                             f"{cu.dtype} of shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold one batch (the same length); got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
