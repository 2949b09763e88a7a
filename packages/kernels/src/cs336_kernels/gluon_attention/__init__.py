"""FlashAttention for Hopper (sm_90) written in Gluon: warp-specialised TMA producer, wgmma consumers.

See :mod:`~cs336_kernels.gluon_attention.forward` and :mod:`~cs336_kernels.gluon_attention.backward`. The
kernels need an sm_90 GPU (no interpreter path).
"""

from cs336_kernels.gluon_attention.backward import gluon_attention_backward
from cs336_kernels.gluon_attention.forward import gluon_attention_forward

__all__ = ["gluon_attention_backward", "gluon_attention_forward"]
