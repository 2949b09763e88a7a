"""Running the fused-kernel benchmarks: :func:`run_fused_bench`, every chosen benchmark in order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cs336_harness.progress import progress_bar
from cs336_harness.studies.fused.adamw import bench_adamw
from cs336_harness.studies.fused.block_glue import GLUE_OPS, bench_glue
from cs336_harness.studies.fused.config import BENCHES, FusedBenchConfig
from cs336_harness.studies.fused.linear_ce import bench_linear_ce


def run_fused_bench(config: FusedBenchConfig, progress: bool = False,
                    write: Callable[[list[dict[str, Any]]], Any] | None = None) -> list[dict[str, Any]]:
    """Rows of every benchmark in ``config.benches``, in :data:`BENCHES` order; with ``progress``, a bar on stderr
    counts the benchmarks done and names the one running; ``write`` (e.g. a
    :class:`~cs336_harness.results.RowWriter`) gets each benchmark's rows as it finishes."""
    runs: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "adamw": lambda: bench_adamw(config), "linear-ce": lambda: bench_linear_ce(config),
        **{op: lambda op=op: bench_glue(op, config) for op in GLUE_OPS},
    }
    chosen = [name for name in BENCHES if name in config.benches]
    bar = progress_bar(total=len(chosen), desc="fused", enabled=progress, unit="benchmark")
    rows: list[dict[str, Any]] = []
    for name in chosen:
        bar.set_postfix_str(name)
        run_rows = runs[name]()
        if write:
            write(run_rows)
        rows += run_rows
        torch.cuda.empty_cache()
        bar.update()
    bar.close()
    return rows
