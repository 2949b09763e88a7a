"""The kernels, one module each (Liger-Kernel's ``ops/`` split): the Triton (and Gluon) kernels, their launchers,
the registered operators with their fake implementations and autograd formulas, the public function and a plain
PyTorch reference. ``cs336_kernels`` exports the public functions; ``cs336_kernels.nn`` wraps them as modules.

- :mod:`~cs336_kernels.ops.flash_attention` (a subpackage): FlashAttention-2 / -3 forward and backward;
- :mod:`~cs336_kernels.ops.rms_norm`, :mod:`~cs336_kernels.ops.rope`, :mod:`~cs336_kernels.ops.swiglu`: a block's
  glue;
- :mod:`~cs336_kernels.ops.fused_linear_cross_entropy`: the LM head and its loss in token chunks;
- :mod:`~cs336_kernels.ops.fused_adamw`: the optimizer step;
- :mod:`~cs336_kernels.ops._common`: what the launchers share.
"""
