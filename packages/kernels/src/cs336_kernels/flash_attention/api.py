"""FlashAttention-2 as differentiable PyTorch functions: input checks, two ``torch.autograd.Function``
classes and :func:`flash_attention`.

:class:`FlashAttentionTriton` runs the Triton forward (through the custom op
``torch.ops.cs336.flash_attention_forward``) and the Triton backward, or the compiled PyTorch backward;
:class:`FlashAttentionPytorch` runs the tiled PyTorch forward and the compiled PyTorch backward. Both
save only ``O`` and the logsumexp ``L`` for the backward.
"""

from __future__ import annotations

from typing import Literal

import torch

from cs336_kernels.flash_attention.backward import flash_backward_triton
from cs336_kernels.flash_attention.forward import flash_forward_op
from cs336_kernels.flash_attention.reference import as_4d, flash_backward_compiled, flash_forward_pytorch
from cs336_kernels.interpreter import check_device

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BackwardImpl = Literal["triton", "pytorch"]


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
        o, lse = flash_forward_pytorch(as_4d(Q), as_4d(K), as_4d(V), is_causal)
        o = o.view(Q.shape)
        ctx.save_for_backward(lse.view(Q.shape[:-1]), Q, K, V, o)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        lse, Q, K, V, O = ctx.saved_tensors
        q4 = as_4d(Q)
        dq, dk, dv = flash_backward_compiled(
            q4, as_4d(K), as_4d(V), as_4d(O), as_4d(dO), lse.view(q4.shape[:-1]), ctx.is_causal
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
        check_device(Q.device, "flash_attention")
        Q, K, V = _unit_stride(Q), _unit_stride(K), _unit_stride(V)
        o, lse = flash_forward_op(as_4d(Q), as_4d(K), as_4d(V), is_causal)
        o = o.view(Q.shape)
        ctx.save_for_backward(lse.view(Q.shape[:-1]), Q, K, V, o)
        ctx.is_causal = is_causal
        ctx.backward_impl = backward
        return o

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        lse, Q, K, V, O = ctx.saved_tensors
        q4 = as_4d(Q)
        args = (q4, as_4d(K), as_4d(V), as_4d(O), as_4d(_unit_stride(dO)), lse.view(q4.shape[:-1]), ctx.is_causal)
        backward = flash_backward_triton if ctx.backward_impl == "triton" else flash_backward_compiled
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
