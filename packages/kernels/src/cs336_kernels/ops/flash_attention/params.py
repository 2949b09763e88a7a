"""What shapes the scores besides Q, K and V: the softmax scale, a logit softcap, the window of keys a query sees
(causal, sliding), the diagonal's alignment and the sequences of a packed batch; checked once, read by every kernel.

The meaning is FlashAttention-2's (``flash_attn_func`` / ``flash_attn_varlen_func``):

- scores are ``s = q . k * softmax_scale`` (default ``1 / sqrt(d)``), then ``softcap * tanh(s / softcap)`` when
  ``softcap > 0`` (Gemma-2's logit cap);
- query ``i`` of a sequence with ``Tq`` queries and ``Tk`` keys sits on key ``i + Tk - Tq`` (the diagonal aligned
  bottom-right) and sees keys ``i + Tk - Tq - left .. i + Tk - Tq + right`` of ``window_size = (left, right)``, a
  negative side being unbounded; ``causal`` is ``right = 0``. Top-left alignment (key ``i`` is query ``i``'s
  diagonal, as in ``scaled_dot_product_attention(is_causal=True)``) is kept for the course's autograd Functions;
- a query that sees no key (``Tq > Tk`` under the causal mask, say) gets a zero output, a zero gradient and a
  logsumexp of ``-inf``;
- packed sequences: q (total_q, heads, d) and k, v (total_k, heads_kv, d) hold the sequences one after another,
  sequence ``b`` at rows ``cu_seqlens[b] .. cu_seqlens[b + 1]`` (int32, ``batch + 1`` entries, first 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from cs336_kernels.ops._common import LOG2E

UNBOUNDED = 1 << 30
"""An unbounded window side as the kernels take it: more keys than any sequence (or tile past its end) has, and far
enough from int32's end that a position plus it stays an int32."""


@dataclass(frozen=True)
class Params:
    """The scores' parameters of one attention call (see the module docstring)."""

    softmax_scale: float
    window_left: int = -1
    window_right: int = -1
    bottom_right: bool = True
    softcap: float = 0.0
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def plain(self) -> bool:
        """No window, no softcap, no packed sequences: what every kernel runs (any scale, either alignment
        when Tq == Tk)."""
        return self.window_left < 0 and self.window_right in (-1, 0) and self.softcap == 0 and not self.varlen

    def kernel_args(self, n_queries: int, n_keys: int) -> dict:
        """The kernels' scalar arguments for a dense batch's Tq, Tk: the lengths (a packed batch's: its longest
        sequences' rounded up to a power of two, which only the autotuner reads), the diagonal's offset, both window
        sides (an unbounded side as :data:`UNBOUNDED`), the scale in log2 units and the softcap's two factors."""
        if self.varlen:
            # Powers of two: an autotuner keyed on these tunes once per size class, not once per batch.
            n_queries, n_keys = (triton.next_power_of_2(max(n, 1)) for n in (self.max_seqlen_q, self.max_seqlen_k))
        cap = self.softcap
        return {
            "N_QUERIES": n_queries,
            "N_KEYS": n_keys,
            "DIAG": n_keys - n_queries if self.bottom_right else 0,
            "WIN_L": self.window_left if self.window_left >= 0 else UNBOUNDED,
            "WIN_R": self.window_right if self.window_right >= 0 else UNBOUNDED,
            # With a softcap the scores reach the softmax already in log2 units: softcap_out folds log2(e) in.
            "qk_scale": 1.0 if cap else self.softmax_scale * LOG2E,
            "softcap_in": self.softmax_scale / cap if cap else 0.0,
            "softcap_out": cap * LOG2E if cap else 0.0,
        }


def make_params(
    head_dim: int, causal: bool, softmax_scale: float | None, window_size: tuple[int, int], softcap: float,
    bottom_right: bool = True, cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int = 0, max_seqlen_k: int = 0,
) -> Params:
    """:class:`Params` from the public functions' arguments, each checked (a ValueError or TypeError naming
    what was expected)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not (
        math.isfinite(softmax_scale) and softmax_scale > 0
    ):
        raise ValueError(f"softmax_scale must be a finite positive number or None, got {softmax_scale!r}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded; got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size sides must be >= 0, or -1 for unbounded; got {tuple(window_size)}")
    if causal:
        right = 0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (
        math.isfinite(softcap) and softcap >= 0
    ):
        raise ValueError(f"softcap must be a finite number >= 0 (0: none), got {softcap!r}")
    return Params(float(softmax_scale), left, right, bottom_right, float(softcap), cu_seqlens_q, cu_seqlens_k,
                  max_seqlen_q, max_seqlen_k)
