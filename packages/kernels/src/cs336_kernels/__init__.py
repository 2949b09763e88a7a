"""cs336_kernels: Triton kernels for Transformer training, each with a PyTorch reference.

The functions here are the public API, each a registered operator (``torch.ops.cs336.*``) with a fake
implementation and an autograd formula, so they run eagerly, inside ``torch.compile(fullgraph=True)`` (no graph
break, dynamic shapes) and under FSDP2:

- :func:`flash_attention` and :func:`flash_attention_varlen` (packed sequences), with FlashAttention-2's
  arguments (causal, sliding window, softcap, softmax scale, logsumexp; FlashAttention-2 in Triton,
  FlashAttention-3-style Gluon kernels on sm_90), :class:`FlashAttentionTriton` / :class:`FlashAttentionPytorch`
  (the course's autograd Functions), :func:`attention_reference` and :func:`attention_reference_varlen`;
- the glue of a Transformer block: :func:`rms_norm`, :func:`add_rms_norm` (the residual add before a norm folded
  into it), :func:`rope` (queries and keys in the projections' layout) and :func:`silu_mul` (SwiGLU's
  ``silu(a) * b``), each with its ``*_reference``;
- :func:`fused_linear_cross_entropy` (LM head + cross-entropy without the logits) and
  :func:`linear_cross_entropy_reference`;
- :class:`FusedAdamW`, AdamW in one launch per parameter group and dtype.

:mod:`cs336_kernels.nn` wraps them as ``nn.Module`` layers with ``torch.nn`` / ``cs336_basics`` parameter names;
:mod:`cs336_kernels.ops` holds the kernels, one module each.

The kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter when ``TRITON_INTERPRET=1`` is
set before this package is imported (install ``cs336-kernels[cpu]`` for the interpreter's numpy).
"""

from importlib.metadata import PackageNotFoundError, version

from cs336_kernels import nn  # the module layer, over the functions above
from cs336_kernels.ops.flash_attention import (
    FlashAttentionPytorch,
    FlashAttentionTriton,
    attention_reference,
    attention_reference_varlen,
    flash_attention,
    flash_attention_varlen,
)
from cs336_kernels.ops.fused_adamw import FusedAdamW
from cs336_kernels.ops.fused_linear_cross_entropy import (
    CHUNK_BYTES,
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
)
from cs336_kernels.ops.rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from cs336_kernels.ops.rope import rope, rope_reference
from cs336_kernels.ops.swiglu import silu_mul, silu_mul_reference

try:
    __version__ = version("cs336-kernels")
except PackageNotFoundError:  # imported from a source tree on PYTHONPATH, not installed (the GPU machine)
    __version__ = "unknown"

__all__ = [
    "CHUNK_BYTES",
    "FlashAttentionPytorch",
    "FlashAttentionTriton",
    "FusedAdamW",
    "__version__",
    "add_rms_norm",
    "add_rms_norm_reference",
    "attention_reference",
    "attention_reference_varlen",
    "flash_attention",
    "flash_attention_varlen",
    "fused_linear_cross_entropy",
    "linear_cross_entropy_reference",
    "nn",
    "rms_norm",
    "rms_norm_reference",
    "rope",
    "rope_reference",
    "silu_mul",
    "silu_mul_reference",
]
