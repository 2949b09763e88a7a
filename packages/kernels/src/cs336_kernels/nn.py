"""Modules over the kernels, for models built from ``nn.Module`` layers (Liger-Kernel's ``transformers/`` split).

Each is a thin wrapper over a function of :mod:`cs336_kernels`, with the parameter names and shapes of its
``torch.nn`` or ``cs336_basics.model`` counterpart, so a state dict loads into either:

- :class:`RMSNorm` (``weight`` (d,)): ``torch.nn.RMSNorm``, ``cs336_basics.model.RMSNorm``;
- :class:`SwiGLU` (``w1``, ``w2``, ``w3``, each a bias-free ``weight`` (out, in)): ``cs336_basics.model.SwiGLU``;
- :class:`CausalSelfAttention` (``q_proj``, ``k_proj``, ``v_proj``, ``output_proj``) with rotary embeddings:
  ``cs336_basics.model.CausalMultiHeadSelfAttention``;
- :class:`FusedLinearCrossEntropyLoss` (no parameters: the head's weight is an argument, so the module that
  owns it, and FSDP's gathering of it, stay as they are).

    norm = cs336_kernels.nn.RMSNorm(4096).cuda()
    norm.load_state_dict(torch.nn.RMSNorm(4096).state_dict())
"""

from __future__ import annotations

import torch

from cs336_kernels.ops.flash_attention import flash_attention
from cs336_kernels.ops.fused_linear_cross_entropy import REDUCTIONS, fused_linear_cross_entropy
from cs336_kernels.ops.rms_norm import rms_norm
from cs336_kernels.ops.rope import rope
from cs336_kernels.ops.swiglu import silu_mul


def _check_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class RMSNorm(torch.nn.Module):
    """``rms_norm(x, weight, eps)`` over the last dim: statistics in fp32, the result in x's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device: torch.device | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        _check_size("hidden_size", hidden_size)
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.eps}"


class SwiGLU(torch.nn.Module):
    """The feed-forward ``w2(silu(w1 x) * w3 x)``, the gate ``silu(a) * b`` in one kernel each way."""

    def __init__(self, d_model: int, d_ff: int, device: torch.device | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        _check_size("d_model", d_model)
        _check_size("d_ff", d_ff)
        self.w1 = torch.nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.w2 = torch.nn.Linear(d_ff, d_model, bias=False, device=device, dtype=dtype)
        self.w3 = torch.nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(silu_mul(self.w1(x), self.w3(x)))


class CausalSelfAttention(torch.nn.Module):
    """Causal multi-head self-attention with rotary position embeddings (Su et al., 2021) on queries and keys.

    q, k and v stay in the projections' (batch, seq, heads, head_dim) layout: :func:`~cs336_kernels.rope`
    rotates q and k there and :func:`~cs336_kernels.flash_attention` reads the (batch, heads, seq, head_dim)
    transposed views without a copy. The rotary tables are ``cs336_basics.model.RotaryEmbedding``'s (fp32, built in
    float64), kept as non-persistent buffers, so the state dict holds the four projections only; casting the module
    (``.bfloat16()``, ``.to(dtype)``) casts the projections and leaves the tables fp32.

    Args:
        d_model, num_heads: model width and heads (d_model a multiple of num_heads, an even head dim).
        context_length: positions the rotary tables cover.
        rope_theta: the rotary base.
        backward, forward: the attention implementations (see :func:`~cs336_kernels.flash_attention`).
    """

    def __init__(self, d_model: int, num_heads: int, context_length: int, rope_theta: float = 10000.0,
                 device: torch.device | None = None, dtype: torch.dtype | None = None, *, backward: str = "auto",
                 forward: str = "auto"):
        super().__init__()
        for name, value in (("d_model", d_model), ("num_heads", num_heads), ("context_length", context_length)):
            _check_size(name, value)
        if d_model % num_heads or (d_model // num_heads) % 2:
            raise ValueError(f"d_model ({d_model}) must be num_heads ({num_heads}) times an even head dim")
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.backward_impl, self.forward_impl = backward, forward
        for name in ("q_proj", "k_proj", "v_proj", "output_proj"):
            setattr(self, name, torch.nn.Linear(d_model, d_model, bias=False, device=device, dtype=dtype))
        inv_freq = rope_theta ** (-torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float64)
                                  / self.head_dim)  # (head_dim / 2,)
        angles = torch.arange(context_length, device=device, dtype=torch.float64)[:, None] * inv_freq
        self.register_buffer("cos", angles.cos().float(), persistent=False)  # (context, head_dim / 2)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def _apply(self, fn, recurse=True):
        # RoPE rotates in fp32 from fp32 tables (rope refuses others): a cast of the module (.bfloat16(), .half(),
        # .to(dtype)) changes the projections, and the tables only follow the device, their values unrounded.
        tables = {"cos": self.cos, "sin": self.sin}
        super()._apply(fn, recurse)
        for name, table in tables.items():
            if getattr(self, name).dtype != torch.float32:
                setattr(self, name, table.to(getattr(self, name).device))
        return self

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, seq, d_model) -> (batch, seq, d_model); ``token_positions`` (seq,) or (batch, seq), default
        ``0..seq-1``."""
        batch, seq, _ = x.shape
        shape = (batch, seq, self.num_heads, self.head_dim)
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        if token_positions is None:
            token_positions = torch.arange(seq, device=x.device)
        q, k = rope(q, k, self.cos, self.sin, token_positions)  # (B, T, H, Dh)
        out = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True,
                              backward=self.backward_impl, forward=self.forward_impl)  # (B, H, T, Dh)
        return self.output_proj(out.transpose(1, 2).reshape(batch, seq, self.d_model))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_heads={self.num_heads}, context_length={self.cos.shape[0]}"


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """``loss = module(hidden, weight, targets)``: :func:`~cs336_kernels.fused_linear_cross_entropy`, the
    cross-entropy of ``hidden @ weight.T`` without the logits, in fp32."""

    def __init__(self, reduction: str = "mean", ignore_index: int = -100, chunk_size: int | None = None) -> None:
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.reduction, self.ignore_index, self.chunk_size = reduction, ignore_index, chunk_size

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return fused_linear_cross_entropy(hidden, weight, targets, self.reduction, self.ignore_index,
                                          chunk_size=self.chunk_size)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, chunk_size={self.chunk_size}"
