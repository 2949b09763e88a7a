"""A pre-norm decoder-only Transformer language model (the CS336 assignment-1 architecture).

Blocks are ``x + attn(norm(x))`` then ``x + ffn(norm(x))`` with RMSNorm, rotary position embeddings
on queries and keys (Su et al., 2021), causal multi-head attention and a SwiGLU feed-forward
(Shazeer, 2020), followed by a final RMSNorm and an untied LM head.

The attention kernel is looked up as the module-level name ``scaled_dot_product_attention`` each time
attention runs, so a caller can swap it without editing this file::

    import cs336_basics.model
    cs336_basics.model.scaled_dot_product_attention = my_attention  # same signature

Run ``uv run cs336 sizes`` to print the model-size table with parameter counts.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from cs336_basics import deterministic
from cs336_basics.nn_utils import softmax


class Linear(nn.Module):
    """``y = x @ W.T`` with no bias; ``weight`` is (d_out, d_in), truncated-normal initialised."""

    def __init__(self, d_in: int, d_out: int, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if d_in <= 0 or d_out <= 0:
            raise ValueError(f"Linear needs positive sizes, got d_in={d_in}, d_out={d_out}")
        self.d_in, self.d_out = d_in, d_out
        std = math.sqrt(2.0 / (d_in + d_out))
        weight = torch.empty(d_out, d_in, device=device, dtype=dtype)
        self.weight = nn.Parameter(nn.init.trunc_normal_(weight, std=std, a=-3 * std, b=3 * std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.are_deterministic_algorithms_enabled() and x.dim() > 1:
            return deterministic.linear(x, self.weight)
        return x @ self.weight.T

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"


class Embedding(nn.Module):
    """A lookup table; ``weight`` is (vocab_size, d_model), truncated-normal initialised."""

    def __init__(
        self, vocab_size: int, d_model: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ):
        super().__init__()
        if vocab_size <= 0 or d_model <= 0:
            raise ValueError(f"Embedding needs positive sizes, got vocab_size={vocab_size}, d_model={d_model}")
        self.vocab_size, self.d_model = vocab_size, d_model
        weight = torch.empty(vocab_size, d_model, device=device, dtype=dtype)
        self.weight = nn.Parameter(nn.init.trunc_normal_(weight, std=1.0, a=-3.0, b=3.0))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if torch.are_deterministic_algorithms_enabled() and token_ids.dim() > 0:
            return deterministic.embedding(token_ids, self.weight)
        return self.weight[token_ids]

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, d_model={self.d_model}"


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang and Sennrich, 2019), computed in fp32 for stability."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, device: torch.device | None = None, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.are_deterministic_algorithms_enabled() and x.dim() > 1:
            return deterministic.rms_norm(x, self.weight, self.eps)
        in_dtype = x.dtype
        x = x.float()
        rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x * rms * self.weight).to(in_dtype)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """Rotary position embedding: rotates each (even, odd) feature pair by ``pos * theta**(-2i/dim)``."""

    def __init__(self, context_length: int, dim: int, theta: float = 10000.0, device: torch.device | None = None):
        super().__init__()
        if dim % 2 != 0:
            raise ValueError(f"RotaryEmbedding needs an even dim, got {dim}")
        self.context_length, self.dim, self.theta = context_length, dim, theta
        inv_freq = theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)  # (dim/2,)
        angles = torch.arange(context_length, device=device, dtype=torch.float64)[:, None] * inv_freq  # (T, dim/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (..., seq, dim) at integer ``token_positions`` (..., seq)."""
        cos = self.cos[token_positions]  # (..., seq, dim/2)
        sin = self.sin[token_positions]
        x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()
        out = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)  # (..., seq, dim/2, 2)
        return out.flatten(-2).to(x.dtype)

    def extra_repr(self) -> str:
        return f"context_length={self.context_length}, dim={self.dim}, theta={self.theta}"


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, d_model: int, d_ff: int, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.w1(x)
        return self.w2(a * torch.sigmoid(a) * self.w3(x))


def scaled_dot_product_attention(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``softmax(Q K^T / sqrt(d)) V`` over (..., queries, d) and (..., keys, d).

    Args:
        mask: boolean (queries, keys), broadcastable; True where a query may attend to a key.
    """
    d = Q.shape[-1]
    scores = Q @ K.transpose(-2, -1) / math.sqrt(d)  # (..., Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores, dim=-1) @ V


class CausalMultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask and RoPE on queries and keys."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        positional_encoder: RotaryEmbedding | None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if d_model % num_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.d_model, self.num_heads = d_model, num_heads
        self.head_dim = d_model // num_heads
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.positional_encoder = positional_encoder

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None) -> torch.Tensor:
        *batch, seq, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(*batch, seq, self.num_heads, self.head_dim).transpose(-3, -2)  # (..., H, T, Dh)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        if self.positional_encoder is not None:
            if token_positions is None:
                token_positions = torch.arange(seq, device=x.device)
            q = self.positional_encoder(q, token_positions)
            k = self.positional_encoder(k, token_positions)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()  # (T, T)
        out = scaled_dot_product_attention(q, k, v, mask=causal)  # (..., H, T, Dh)
        out = out.transpose(-3, -2).reshape(*batch, seq, self.d_model)  # (..., T, D)
        return self.output_proj(out)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``h + ffn(ln2(h))``."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        positional_encoder: RotaryEmbedding | None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.ln1 = RMSNorm(d_model, device=device, dtype=dtype)
        self.attn = CausalMultiHeadSelfAttention(d_model, num_heads, positional_encoder, device=device, dtype=dtype)
        self.ln2 = RMSNorm(d_model, device=device, dtype=dtype)
        self.ffn = SwiGLU(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class BasicsTransformerLM(nn.Module):
    """Decoder-only LM: embeddings, ``num_layers`` blocks, final RMSNorm, untied LM head."""

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        rope_theta: float = 10000.0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        for name, value in dict(
            vocab_size=vocab_size,
            context_length=context_length,
            d_model=d_model,
            num_layers=num_layers,
            num_heads=num_heads,
            d_ff=d_ff,
        ).items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if d_model % num_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.vocab_size, self.context_length = vocab_size, context_length
        self.d_model, self.num_layers, self.num_heads, self.d_ff = d_model, num_layers, num_heads, d_ff
        self.token_embeddings = Embedding(vocab_size, d_model, device=device, dtype=dtype)
        rope = RotaryEmbedding(context_length, d_model // num_heads, rope_theta, device=device)
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, num_heads, d_ff, rope, device=device, dtype=dtype) for _ in range(num_layers)
        )
        self.ln_final = RMSNorm(d_model, device=device, dtype=dtype)
        self.lm_head = Linear(d_model, vocab_size, device=device, dtype=dtype)

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; ``non_embedding`` leaves out the token embeddings (not the LM head)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.token_embeddings.weight.numel() if non_embedding else n

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) for ``token_ids`` (batch, seq)."""
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids must be (batch, seq), got shape {tuple(token_ids.shape)}")
        if token_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"token_ids must be int32 or int64, got {token_ids.dtype}")
        if not 1 <= token_ids.shape[1] <= self.context_length:
            raise ValueError(
                f"sequence length must be in [1, context_length={self.context_length}], got {token_ids.shape[1]}"
            )
        if not torch.compiler.is_compiling():
            lo, hi = (int(v) for v in torch.stack(torch.aminmax(token_ids)).tolist())  # one sync, a clear error
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got range [{lo}, {hi}]")
        x = self.token_embeddings(token_ids)  # (B, T, D)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))  # (B, T, V)
