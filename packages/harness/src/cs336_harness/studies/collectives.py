"""The handout's collectives benchmark over backends, world sizes and sizes (``cs336 collectives``).

Each (backend, world size) is one run of :func:`cs336_comms.collectives.run_collectives` (spawned ranks, or
torchrun's); its rows carry time, algorithm and bus bandwidth per op and size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cs336_comms.collectives import OPS, run_collectives

from cs336_harness.analysis.tables import markdown_table
from cs336_harness.progress import progress_bar
from cs336_harness.studies.distributed import check_backend


@dataclass(frozen=True)
class CollectivesConfig:
    backends: tuple[str, ...]
    world_sizes: tuple[int, ...]
    sizes_mb: tuple[float, ...]
    ops: tuple[str, ...] = OPS
    warmup: int = 5
    iters: int = 20

    def __post_init__(self) -> None:
        if not self.world_sizes or any(n < 1 for n in self.world_sizes):
            raise ValueError(f"world sizes must be positive, got {self.world_sizes}")
        if not self.backends:
            raise ValueError("backends must be gloo and/or nccl, got none")
        if not self.sizes_mb or any(s <= 0 for s in self.sizes_mb):
            raise ValueError(f"sizes must be positive MiB values, got {self.sizes_mb}")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"ops must be a subset of {OPS}, got {self.ops}")
        if self.warmup < 0 or self.iters < 1:
            raise ValueError(f"need warmup >= 0 and iters >= 1, got {self.warmup}, {self.iters}")
        for backend in self.backends:  # last: the values above are wrong anywhere, a backend only on this machine
            check_backend(backend, max(self.world_sizes))


def run_collectives_study(config: CollectivesConfig, progress: bool = False,
                          write: Callable[[list[dict[str, Any]]], Any] | None = None) -> list[dict[str, Any]]:
    """Every (backend, world size) of ``config``; [] on a torchrun rank other than 0. With ``progress``, a bar on
    stderr counts the (backend, world size) runs (each spawns its ranks once and times every op and size);
    ``write`` (e.g. a :class:`~cs336_harness.results.RowWriter`) gets each run's rows as it finishes."""
    sizes_bytes = [int(mb * 2**20) for mb in config.sizes_mb]
    runs = [(backend, ws) for backend in config.backends for ws in config.world_sizes]
    bar = progress_bar(total=len(runs), desc="collectives", enabled=progress, unit="run")
    rows = []
    for backend, ws in runs:
        bar.set_postfix_str(f"{backend}, {ws} ranks: {len(config.ops)} ops x {len(sizes_bytes)} sizes")
        run_rows = run_collectives(ws, backend, sizes_bytes, config.ops, config.warmup, config.iters)
        if run_rows and write:
            write(run_rows)
        rows += run_rows
        bar.update()
    bar.close()
    return rows


def collectives_markdown(rows: Sequence[dict[str, Any]], op: str = "all_reduce") -> str:
    """Bus bandwidth (GB/s) and time (ms) of ``op``: one line per (backend, world size), one column per size.

    Sizes are matched by their label (3 significant digits), since each run rounds the size down to a
    multiple of its world size.
    """
    chosen = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])
    labels = list(dict.fromkeys(_size_label(r["bytes"]) for r in chosen))
    lines = []
    for backend, ws in sorted({(r["backend"], r["world_size"]) for r in chosen}):
        line: dict[str, Any] = {"backend": backend, "world_size": ws}
        for r in chosen:
            if (r["backend"], r["world_size"]) == (backend, ws):
                line[_size_label(r["bytes"])] = f"{r['busbw_gbps']:.3g} GB/s, {r['time_ms']:.3g} ms"
        lines.append(line)
    return markdown_table(lines, ["backend", ("world_size", "ranks"), *labels])


def _size_label(nbytes: int) -> str:
    mib = nbytes / 2**20
    return f"{mib / 1024:.3g} GiB" if mib >= 1024 else f"{mib:.3g} MiB"
