"""Benchmarks of the fused kernels in cs336_kernels against PyTorch (``cs336 fused``), one module each:

- :mod:`~cs336_harness.studies.fused.adamw` (a): one AdamW step, FusedAdamW against torch's foreach and fused
  AdamW, against the bytes floor;
- :mod:`~cs336_harness.studies.fused.linear_ce` (b): LM head + cross-entropy forward and backward, ours against
  plain PyTorch, Liger-Kernel and Cut Cross-Entropy, against the matmul floor, and where the fused time goes;
- :mod:`~cs336_harness.studies.fused.block_glue` (c): a block's RMSNorm, residual add + RMSNorm, RoPE and SiLU-mul
  against torch.compile, the model's code and Liger-Kernel;
- :mod:`~cs336_harness.studies.fused.run` runs the chosen ones (:func:`run_fused_bench`) and
  :mod:`~cs336_harness.studies.fused.report` makes the writeup's tables from the rows (:func:`fused_markdown`);
  :mod:`~cs336_harness.studies.fused.config` and :mod:`~cs336_harness.studies.fused.common` hold the config and
  what the benchmarks share.

Each module's docstring defines its rows' fields and floors::

    from cs336_harness.studies.fused import FusedBenchConfig, run_fused_bench, fused_markdown
    rows = run_fused_bench(FusedBenchConfig())
"""

from cs336_harness.studies.fused.config import BENCHES, FusedBenchConfig
from cs336_harness.studies.fused.report import fused_markdown
from cs336_harness.studies.fused.run import run_fused_bench

__all__ = ["BENCHES", "FusedBenchConfig", "fused_markdown", "run_fused_bench"]
