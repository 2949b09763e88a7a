"""cs336_kernels: Triton kernels for Transformer training, each with a PyTorch reference.

- :func:`flash_attention` (FlashAttention-2, forward and backward), :class:`FlashAttentionTriton`,
  :class:`FlashAttentionPytorch`, :func:`attention_reference`;
- :class:`FusedAdamW`, AdamW in one launch per parameter group and dtype;
- :func:`fused_linear_cross_entropy` (LM head + cross-entropy without the logits),
  :class:`FusedLinearCrossEntropy`, :func:`linear_cross_entropy_reference`;
- the glue of a Transformer block: :func:`rms_norm` (and ``rms_norm.add_rms_norm``, the residual add before a
  norm folded into it), :func:`rope` (queries and keys in the projections' layout) and :func:`silu_mul` (SwiGLU's
  ``silu(a) * b``), forward and backward.

The kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter when ``TRITON_INTERPRET=1`` is
set before this package is imported (install ``cs336-kernels[cpu]`` for the interpreter's numpy).
``flash_attention``, ``fused_linear_cross_entropy``, ``rms_norm`` and ``rope`` are both the submodules and,
called, their functions.
"""

from importlib.metadata import PackageNotFoundError, version

from cs336_kernels import flash_attention, fused_linear_cross_entropy, rms_norm, rope
from cs336_kernels.flash_attention import FlashAttentionPytorch, FlashAttentionTriton, attention_reference
from cs336_kernels.fused_adamw import FusedAdamW
from cs336_kernels.fused_linear_cross_entropy import FusedLinearCrossEntropy, linear_cross_entropy_reference
from cs336_kernels.swiglu import silu_mul

try:
    __version__ = version("cs336-kernels")
except PackageNotFoundError:  # imported from a source tree on PYTHONPATH, not installed (the GPU machine)
    __version__ = "unknown"

__all__ = [
    "FlashAttentionPytorch",
    "FlashAttentionTriton",
    "FusedAdamW",
    "FusedLinearCrossEntropy",
    "__version__",
    "attention_reference",
    "flash_attention",
    "fused_linear_cross_entropy",
    "linear_cross_entropy_reference",
    "rms_norm",
    "rope",
    "silu_mul",
]
