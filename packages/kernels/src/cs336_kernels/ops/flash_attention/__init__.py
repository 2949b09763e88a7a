"""FlashAttention-2 (Dao, 2023) in Triton, with a tiled pure-PyTorch twin and a float64 reference.

Attention ``softmax(Q K^T / sqrt(d)) V`` is computed one query tile at a time with an online softmax
(Milakov & Gimelshein, 2018): a running row maximum ``m`` and denominator ``l`` let each key tile be
folded into an fp32 accumulator without ever writing the (queries x keys) score matrix to memory. The
forward pass saves only the output ``O`` and the row logsumexp ``L``; the backward pass recomputes the
probabilities ``P = exp(S - L)`` tile by tile and uses ``D = rowsum(dO * O)`` in place of the softmax
Jacobian.

Modules, bottom up: ``checks`` (the input checks every path shares), ``tuning`` (tile tables, config lists,
pruning, the autotune key), ``tiles`` (tile loads and ranges both Triton directions share), ``forward`` and
``backward`` (the Triton kernels and their launchers: forward; D pre-pass, dK/dV and dQ), ``gluon_common``,
``gluon_forward`` and ``gluon_backward`` (warp-specialised sm_90 kernels in Gluon, FlashAttention-3 style),
``reference`` (PyTorch reference, tiled forward, compiled backward) and ``api`` (the registered operators, the
autograd Functions, :func:`flash_attention`).

Conventions:
- Shapes are (batch, seq, d) or (batch, heads, seq, d). Keys and values may have fewer heads than
  queries (grouped-query attention): query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
- Causal masking with ``Tq != Tk`` is aligned top-left, as in ``torch.nn.functional.
  scaled_dot_product_attention(is_causal=True)``: query ``i`` sees keys ``0..i``. Every query therefore
  sees at least key 0, so no row is ever empty; keys past ``Tq - 1`` get zero gradient.
- ``L`` is the natural-log logsumexp of the scaled scores, fp32, shaped like ``Q`` without its last dim.
- The Triton backward pass is two kernels without atomics, so it is deterministic; ``backward="auto"`` (the default)
  runs it off sm_90 and the faster Gluon one on sm_90, whose dQ reduce-adds take a fixed order under
  ``torch.use_deterministic_algorithms(True)`` (bitwise-reproducible gradients at some speed, still faster than
  the Triton kernels).
- fp32 inputs use true fp32 products (``input_precision="ieee"``), not TF32.

Run the tests with ``uv run pytest packages/kernels/tests/test_flash_attention.py`` (on CPU they use
the Triton interpreter) and the benchmarks with ``cs336 attention --help``.
"""

from __future__ import annotations

from cs336_kernels.ops.flash_attention.api import (
    BACKWARD_IMPLS,
    FORWARD_IMPLS,
    BackwardImpl,
    FlashAttentionPytorch,
    FlashAttentionTriton,
    ForwardImpl,
    backward_impl,
    flash_attention,
    flash_attention_backward_op,
    flash_attention_op,
    flash_attention_varlen,
    forward_impl,
)
from cs336_kernels.ops.flash_attention.checks import MAX_HEAD_DIM, MIN_HEAD_DIM, SUPPORTED_DTYPES
from cs336_kernels.ops.flash_attention.params import Params, make_params
from cs336_kernels.ops.flash_attention.reference import attention_reference, attention_reference_varlen

__all__ = [
    "BACKWARD_IMPLS",
    "FORWARD_IMPLS",
    "MAX_HEAD_DIM",
    "MIN_HEAD_DIM",
    "SUPPORTED_DTYPES",
    "BackwardImpl",
    "FlashAttentionPytorch",
    "FlashAttentionTriton",
    "ForwardImpl",
    "Params",
    "attention_reference",
    "attention_reference_varlen",
    "backward_impl",
    "flash_attention",
    "flash_attention_backward_op",
    "flash_attention_op",
    "flash_attention_varlen",
    "forward_impl",
    "make_params",
]
