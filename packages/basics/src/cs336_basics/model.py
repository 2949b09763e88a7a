"""A pre-norm decoder-only Transformer language model (the CS336 assignment-1 architecture).

Blocks are ``x + attn(norm(x))`` then ``x + ffn(norm(x))`` with RMSNorm, rotary position embeddings
on queries and keys (Su et al., 2021), causal multi-head attention and a SwiGLU feed-forward
(Shazeer, 2020), followed by a final RMSNorm and an untied LM head.

The model is built from the course's positional arguments or from a :class:`~cs336_basics.config.ModelConfig`,
and owns the implementations of its pieces, one :class:`BlockKernels` value given at construction (the model's own
PyTorch code by default), so kernels with the same numerics run them without touching the weights or their names:

- ``attention``: ``fn(q, k, v, is_causal) -> out`` over (batch, heads, seq, head_dim) tensors, returning
  (batch, heads, seq, head_dim) (:func:`eager_attention`, the default, or :func:`sdpa_attention`);
- ``norm``: ``fn(x, weight, eps) -> y``, every RMSNorm (the signature of ``cs336_kernels.rms_norm``);
- ``add_norm``: ``fn(x, delta, weight, eps) -> (x + delta, norm(x + delta))``, each block's first residual add and
  its second norm in one op (``cs336_kernels.add_rms_norm``);
- ``rotary``: ``fn(q, k, cos, sin, token_positions) -> (q, k)``, RoPE on q and k in the projections' (batch, seq,
  heads, head_dim) layout (``cs336_kernels.rope``);
- ``gate``: ``fn(a, b) -> silu(a) * b``, SwiGLU's gate (``cs336_kernels.silu_mul``);
- ``loss``: ``fn(hidden, weight, targets) -> mean loss`` over (tokens, d_model) hidden states, the (vocab, d_model)
  head weight and (tokens,) targets: the LM head's loss without materialising the logits
  (``cs336_kernels.fused_linear_cross_entropy``).

::

    from cs336_basics.config import ModelConfig
    from cs336_basics.model import BasicsTransformerLM, BlockKernels, sdpa_attention
    model = BasicsTransformerLM.from_config(ModelConfig.from_preset("small"),
                                            kernels=BlockKernels(attention=sdpa_attention))
    loss = model(token_ids, targets)            # mean cross-entropy; model(token_ids) gives the logits

Queries, keys and values stay in the projections' (batch, seq, heads, head_dim) layout so that kernels read them
without copies. Run ``uv run cs336 sizes`` to print the size presets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from cs336_basics import deterministic
from cs336_basics.config import ModelConfig
from cs336_basics.nn_utils import cross_entropy, softmax


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


NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def _check_optional_fn(name: str, fn: object, signature: str) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be None or a callable {signature}, got {type(fn).__name__}")


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang and Sennrich, 2019), computed in fp32 for stability.

    ``norm``: None runs the code below; or ``fn(x, weight, eps) -> y`` with the same numerics (statistics in fp32,
    the result rounded once to x's dtype), for a kernel.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, device: torch.device | None = None, dtype: torch.dtype | None = None,
        *, norm: NormFn | None = None,
    ):
        super().__init__()
        _check_optional_fn("norm", norm, "fn(x, weight, eps)")
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            return self.norm(x, self.weight, self.eps)
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


GateFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def silu_gate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate ``silu(a) * b``, written as ``a * sigmoid(a) * b`` (each op rounds to the input dtype)."""
    return a * torch.sigmoid(a) * b


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``.

    ``gate`` computes ``silu(a) * b`` from ``a = w1 x`` and ``b = w3 x`` (default :func:`silu_gate`), so a fused
    kernel with the same rounding can take its place without touching the weights.
    """

    def __init__(self, d_model: int, d_ff: int, device: torch.device | None = None, dtype: torch.dtype | None = None,
                 *, gate: GateFn = silu_gate):
        super().__init__()
        if not callable(gate):
            raise TypeError(f"gate must be a callable fn(a, b) -> silu(a) * b, got {type(gate).__name__}")
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gate(self.w1(x), self.w3(x)))


def scaled_dot_product_attention(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None = None, is_causal: bool = False
) -> torch.Tensor:
    """``softmax(Q K^T / sqrt(d)) V`` over (..., queries, d) and (..., keys, d), materialising the scores.

    Args:
        mask: boolean (queries, keys), broadcastable; True where a query may attend to a key.
        is_causal: query ``i`` sees keys ``0..i`` (top-left aligned); not combined with ``mask``.
    """
    if is_causal and mask is not None:
        raise ValueError("pass either a mask or is_causal=True, not both")
    d = Q.shape[-1]
    scores = Q @ K.transpose(-2, -1) / math.sqrt(d)  # (..., Tq, Tk)
    if is_causal:
        tq, tk = Q.shape[-2], K.shape[-2]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=Q.device).tril()  # (Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores, dim=-1) @ V


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """The model's own attention: :func:`scaled_dot_product_attention`, scores materialised."""
    return scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """PyTorch's fused attention (cuDNN / FlashAttention / memory-efficient kernels on CUDA)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


RotaryFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                   tuple[torch.Tensor, torch.Tensor]]


AddNormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BlockKernels:
    """How the model's pieces run (the module docstring gives each signature): ``attention`` and ``gate`` are
    callables; ``norm``, ``add_norm``, ``rotary`` and ``loss`` are callables, or None for the model's own code (the
    RMSNorm formula, the add then ``ln2``, the course's ``RotaryEmbedding``, the logits' cross-entropy). The default
    is the model's own PyTorch code throughout."""

    attention: AttentionFn = eager_attention
    norm: NormFn | None = None
    add_norm: AddNormFn | None = None
    rotary: RotaryFn | None = None
    gate: GateFn = silu_gate
    loss: LossFn | None = None

    def __post_init__(self) -> None:
        for name, signature in (("attention", "fn(q, k, v, is_causal)"), ("gate", "fn(a, b) -> silu(a) * b")):
            if not callable(getattr(self, name)):
                raise TypeError(f"{name} must be a callable {signature}, got {type(getattr(self, name)).__name__}")
        for name, signature in (("norm", "fn(x, weight, eps)"), ("add_norm", "fn(x, delta, weight, eps)"),
                                ("rotary", "fn(q, k, cos, sin, token_positions)"),
                                ("loss", "fn(hidden, weight, targets)")):
            _check_optional_fn(name, getattr(self, name), signature)


def _check_kernels(kernels: object) -> BlockKernels:
    if not isinstance(kernels, BlockKernels):
        raise TypeError(f"kernels must be a BlockKernels, got {type(kernels).__name__}")
    return kernels


# The model's own PyTorch code for every piece.
PYTORCH_KERNELS = BlockKernels()


class CausalMultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask and RoPE on queries and keys.

    Queries, keys and values stay in the (batch, seq, heads, head_dim) layout the projections produce (views, no
    copy); the attention sees (batch, heads, seq, head_dim) transposed views of them, so a kernel that takes strides
    reads them in place. Of ``kernels`` (:class:`BlockKernels`) it runs two, and ``fused_qkv`` chooses the
    projections:

    - ``kernels.attention``: ``fn(q, k, v, is_causal) -> out`` over those (batch, heads, seq, head_dim) views,
      returning (batch, heads, seq, head_dim).
    - ``kernels.rotary``: None rotates with ``positional_encoder`` (the course's ``RotaryEmbedding``, on the
      heads-first views); or ``fn(q, k, cos, sin, token_positions) -> (q, k)`` over (batch, seq, heads, head_dim)
      q and k and the encoder's fp32 ``cos`` / ``sin`` tables (the signature of ``cs336_kernels.rope``), for a
      kernel that rotates both in the projections' layout.
    - ``fused_qkv``: compute q, k and v by one matmul with the (3 d_model, d_model) concatenation of the three
      projection weights instead of three matmuls (the weights stay three parameters under their names; every
      output element is the same dot product, so results agree to rounding; in deterministic mode the three
      projections run as usual).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        positional_encoder: RotaryEmbedding | None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        *,
        kernels: BlockKernels = PYTORCH_KERNELS,
        fused_qkv: bool = False,
    ):
        super().__init__()
        if d_model % num_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        if not isinstance(fused_qkv, bool):
            raise TypeError(f"fused_qkv must be a bool, got {type(fused_qkv).__name__}")
        kernels = _check_kernels(kernels)
        self.d_model, self.num_heads = d_model, num_heads
        self.head_dim = d_model // num_heads
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.positional_encoder = positional_encoder
        self.attention = kernels.attention
        self.rotary = kernels.rotary
        self.fused_qkv = fused_qkv

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as (..., T, H, Dh) views of the projections' outputs."""
        *batch, seq, _ = x.shape
        # Deterministic mode keeps the three projections: their Linear modules own the batch-invariant path.
        if self.fused_qkv and not torch.are_deterministic_algorithms_enabled():
            weight = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))  # (3D, D)
            qkv = x @ weight.T  # (..., T, 3D)
            # unbind's backward stacks the three gradients into one (..., T, 3, H, Dh) tensor: one copy.
            return qkv.view(*batch, seq, 3, self.num_heads, self.head_dim).unbind(-3)
        shape = (*batch, seq, self.num_heads, self.head_dim)
        return self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)

    def _rotate(self, q: torch.Tensor, k: torch.Tensor,
                token_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k (..., T, H, Dh) rotated by their positions, still (..., T, H, Dh) (any strides)."""
        encoder = self.positional_encoder
        if self.rotary is not None:
            return self.rotary(q, k, encoder.cos, encoder.sin, token_positions)
        # The course's RotaryEmbedding works on (..., seq, dim): give it the heads-first views.
        q = encoder(q.transpose(-3, -2), token_positions).transpose(-3, -2)
        k = encoder(k.transpose(-3, -2), token_positions).transpose(-3, -2)
        return q, k

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None) -> torch.Tensor:
        *batch, seq, _ = x.shape
        q, k, v = self._project(x)  # (..., T, H, Dh)
        if self.positional_encoder is not None:
            if token_positions is None:
                token_positions = torch.arange(seq, device=x.device)
            q, k = self._rotate(q, k, token_positions)
        out = self.attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), True)  # (..., H, T, Dh)
        out = out.transpose(-3, -2).reshape(*batch, seq, self.d_model)  # (..., T, D)
        return self.output_proj(out)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(ln1(x))``, then ``h + ffn(ln2(h))``, its pieces run by ``kernels``
    (:class:`BlockKernels`): ``norm`` in both RMSNorms, ``attention`` and ``rotary`` in the attention, ``gate`` in the
    SwiGLU. ``kernels.add_norm``: None runs the add and ``ln2`` as written; or ``fn(x, delta, weight, eps) -> (h, y)``
    with ``delta = attn(ln1(x))`` and ``ln2``'s own ``weight`` and ``eps``, returning ``h = x + delta`` and
    ``y = ln2(h)`` (the signature of ``cs336_kernels.add_rms_norm``), for a kernel that computes both in one pass.
    ``ln2`` keeps its weight either way, so parameter names do not change.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        positional_encoder: RotaryEmbedding | None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        *,
        kernels: BlockKernels = PYTORCH_KERNELS,
        fused_qkv: bool = False,
    ):
        super().__init__()
        kernels = _check_kernels(kernels)
        self.ln1 = RMSNorm(d_model, device=device, dtype=dtype, norm=kernels.norm)
        self.attn = CausalMultiHeadSelfAttention(d_model, num_heads, positional_encoder, device=device, dtype=dtype,
                                                 kernels=kernels, fused_qkv=fused_qkv)
        self.ln2 = RMSNorm(d_model, device=device, dtype=dtype, norm=kernels.norm)
        self.ffn = SwiGLU(d_model, d_ff, device=device, dtype=dtype, gate=kernels.gate)
        self.add_norm = kernels.add_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.add_norm is None:
            x = x + self.attn(self.ln1(x))
            return x + self.ffn(self.ln2(x))
        h, y = self.add_norm(x, self.attn(self.ln1(x)), self.ln2.weight, self.ln2.eps)
        return h + self.ffn(y)


class TransformerBlocks(nn.ModuleList):
    """The stack of blocks, run in order by ``forward``. Activation checkpointing replaces the model's stack by one
    that holds the same blocks under the same names and runs them in checkpointed segments."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self:
            x = block(x)
        return x


class LMHead(Linear):
    """The output projection: logits (..., vocab), or with ``targets`` (...) their mean cross-entropy.

    ``loss``: None computes the logits and :func:`~cs336_basics.nn_utils.cross_entropy`; or
    ``fn(hidden, weight, targets) -> mean loss`` over (tokens, d_in) hidden states, this head's (vocab, d_in)
    ``weight`` and (tokens,) targets, for a fused linear + cross-entropy that never materialises the logits. The
    head keeps its weight either way: it stays the module that owns it (and that FSDP gathers it for).
    """

    def __init__(self, d_in: int, d_out: int, device: torch.device | None = None, dtype: torch.dtype | None = None,
                 *, loss: LossFn | None = None):
        super().__init__(d_in, d_out, device=device, dtype=dtype)
        _check_optional_fn("loss", loss, "fn(hidden, weight, targets)")
        self.loss = loss

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is not None and self.loss is not None:
            return self.loss(x.flatten(0, -2), self.weight, targets.flatten())  # (N, d), (V, d), (N,) -> scalar
        logits = super().forward(x)
        return logits if targets is None else cross_entropy(logits, targets)


class BasicsTransformerLM(nn.Module):
    """Decoder-only LM: embeddings, ``num_layers`` blocks, final RMSNorm, untied LM head.

    ``kernels`` (:class:`BlockKernels`, the module docstring) runs the pieces: every block's, ``norm`` in the final
    RMSNorm too, and ``loss`` in the LM head; ``fused_qkv`` computes q, k and v with one matmul
    (:class:`CausalMultiHeadSelfAttention`).
    """

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
        *,
        kernels: BlockKernels = PYTORCH_KERNELS,
        fused_qkv: bool = False,
    ):
        super().__init__()
        kernels = _check_kernels(kernels)
        config = ModelConfig(d_model=d_model, d_ff=d_ff, num_layers=num_layers, num_heads=num_heads,
                             vocab_size=vocab_size, context_length=context_length, rope_theta=rope_theta)
        self.config = config
        self.vocab_size, self.context_length = vocab_size, context_length
        self.d_model, self.num_layers, self.num_heads, self.d_ff = d_model, num_layers, num_heads, d_ff
        self.token_embeddings = Embedding(vocab_size, d_model, device=device, dtype=dtype)
        rope = RotaryEmbedding(context_length, config.head_dim, rope_theta, device=device)
        self.layers = TransformerBlocks(
            TransformerBlock(d_model, num_heads, d_ff, rope, device=device, dtype=dtype, kernels=kernels,
                             fused_qkv=fused_qkv)
            for _ in range(num_layers)
        )
        self.ln_final = RMSNorm(d_model, device=device, dtype=dtype, norm=kernels.norm)
        self.lm_head = LMHead(d_model, vocab_size, device=device, dtype=dtype, loss=kernels.loss)

    @classmethod
    def from_config(
        cls, config: ModelConfig, *, kernels: BlockKernels = PYTORCH_KERNELS, fused_qkv: bool = False,
        device: torch.device | None = None, dtype: torch.dtype | None = None,
    ) -> BasicsTransformerLM:
        """The model of ``config``; every other argument as in the constructor."""
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        return cls(config.vocab_size, config.context_length, config.d_model, config.num_layers, config.num_heads,
                   config.d_ff, config.rope_theta, device=device, dtype=dtype, kernels=kernels, fused_qkv=fused_qkv)

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; ``non_embedding`` leaves out the token embeddings (not the LM head)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.token_embeddings.weight.numel() if non_embedding else n

    def _check_tokens(self, token_ids: torch.Tensor) -> None:
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids must be (batch, seq), got shape {tuple(token_ids.shape)}")
        if token_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"token_ids must be int32 or int64, got {token_ids.dtype}")
        if not 1 <= token_ids.shape[1] <= self.context_length:
            raise ValueError(
                f"sequence length must be in [1, context_length={self.context_length}], got {token_ids.shape[1]}"
            )
        # The range check reads the ids: free on CPU, a host sync on a GPU (where an out-of-range id fails the
        # embedding's own device-side bounds check instead).
        if token_ids.device.type == "cpu" and not torch.compiler.is_compiling():
            lo, hi = (int(v) for v in torch.aminmax(token_ids))
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got range [{lo}, {hi}]")

    def hidden_states(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The body up to and including the final norm: (batch, seq, d_model) for ``token_ids`` (batch, seq)."""
        self._check_tokens(token_ids)
        x = self.token_embeddings(token_ids)  # (B, T, D)
        return self.ln_final(self.layers(x))

    def forward(self, token_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) for ``token_ids`` (batch, seq); with ``targets`` (batch, seq), the mean
        cross-entropy over all positions instead."""
        if targets is not None and targets.shape != token_ids.shape:
            raise ValueError(f"targets must have the shape of token_ids {tuple(token_ids.shape)}, got "
                             f"{tuple(targets.shape)}")
        hidden = self.hidden_states(token_ids)
        return self.lm_head(hidden) if targets is None else self.lm_head(hidden, targets)
