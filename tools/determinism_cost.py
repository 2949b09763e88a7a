"""What deterministic mode costs: an xl training step (batch 4, context 512, our AdamW) on one GPU with and
without ``torch.use_deterministic_algorithms(True)``, as results rows.

In deterministic mode the cs336_basics layers run one batch element at a time and sum weight gradients as a
tree (cs336_basics.deterministic); this measures what that costs in time and peak memory. The two modes
alternate (plain, deterministic, plain, deterministic) in one process, each a fresh model timed by
cs336_harness.studies.step_timing (``--warmup`` untimed and ``--steps`` timed steps); every row carries the
provenance of cs336_harness.results and the ``call_id`` of the GPU call (tools/gpu.sh), and the deterministic
rows the ratio of their median step time to the plain median measured just before them::

    bash tools/gpu.sh python3 tools/determinism_cost.py --out writeup/results/determinism.jsonl
"""

from __future__ import annotations

import argparse
import os

# cuBLAS needs a fixed workspace to be deterministic; it must be set before the first cuBLAS call.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from cs336_harness.analysis.tables import format_table  # noqa: E402
from cs336_harness.results import append_rows, provenance  # noqa: E402
from cs336_harness.studies.step_timing import BenchConfig, run_one  # noqa: E402

COLUMNS = ("deterministic", "dtype", "status", "forward_ms_median", "backward_ms_median", "optimizer_ms_median",
           "step_ms_median", "peak_step_gib", "step_ratio_vs_plain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON-lines file the rows are appended to")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="fp32, or bf16 autocast")
    parser.add_argument("--repeats", type=int, default=2, help="plain/deterministic pairs")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("determinism_cost.py times a GPU step; no CUDA device is visible")
    config = BenchConfig(size="xl", batch_size=4, context_length=512, mode="train", dtype=args.dtype,
                         warmup=args.warmup, steps=args.steps, device="cuda")
    meta = provenance()
    rows = []
    for repeat in range(args.repeats):
        for deterministic in (False, True):
            torch.use_deterministic_algorithms(deterministic)
            try:
                row = {**run_one(config), "deterministic": deterministic, "repeat": repeat}
            finally:
                torch.use_deterministic_algorithms(False)
            if deterministic and row["status"] == "ok" and rows[-1]["status"] == "ok":
                row["step_ratio_vs_plain"] = row["step_ms_median"] / rows[-1]["step_ms_median"]
            rows.append(row)
            append_rows(args.out, [row], meta)
    print(format_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
