"""The glue kernels and the LM-head loss kernel by kernel under Nsight Compute (issue 44): what limits each, beside
QuACK's norms and RoPE in the same process. (A copy of the same bytes is no kernel but a DMA memcpy, which ncu does
not profile: the copy's rate is ``cs336 fused --bench``'s.)

Run under ``ncu --profile-from-start off``, each case (an op's forward + backward at the proxy's shapes, bf16, as
``cs336 fused --bench`` builds it) runs twice unprofiled (compiles, warms up) and once between
``cudaProfilerStart``/``Stop``, followed by a ``torch.cuda._sleep`` kernel (``spin_kernel``) that marks where its
kernels end; ``--order`` writes the cases in the order they ran. ``--join`` then reads ncu's raw CSV and that order
and writes one row per kernel (``bench: kernel_profile``: op, impl, kernel, ms, DRAM GB/s and % of peak, SM and
tensor-pipe % of peak, SM clock) and one per case (``kernel: "all"``: the kernels' ms summed and, for the glue, the
bytes the op must move over that time, as ``cs336 fused --bench`` counts them). Clocks are not locked
(``--clock-control none``), so the SM clock is the one the power limit leaves.

    bash tools/gpu_kernel_limits.sh profile      (both steps, on the GPU machine)
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Callable
from pathlib import Path

import torch

MARKER = "spin_kernel"
COMMAND = "bash tools/gpu_kernel_limits.sh profile"
METRICS = {  # ncu metric: row field
    "gpu__time_duration.sum": "ms",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed": "tensor_pct",
    "sm__cycles_elapsed.avg.per_second": "sm_clock_mhz",
    "launch__registers_per_thread": "registers",
    "launch__grid_size": "grid",
}


def _cases() -> list[tuple[str, str, int, Callable[[], None]]]:
    """(op, impl, bytes the op must move or 0, one forward + backward) in the order they are profiled."""
    from cs336_harness.studies.fused.block_glue import (
        add_rms_norm_case,
        glue_step,
        rms_norm_case,
        rope_case,
        swiglu_case,
    )
    from cs336_harness.studies.fused.common import peer_module
    from cs336_harness.studies.fused.config import FusedBenchConfig
    from cs336_kernels import fused_linear_cross_entropy

    c = FusedBenchConfig()
    no_liger = (None, "not profiled")
    quack_norm, quack_rotary = peer_module("quack.rmsnorm"), peer_module("quack.rotary")
    glue = {
        "rms_norm": rms_norm_case(c.tokens, c.d_model, no_liger, quack_norm),
        "add_rms_norm": add_rms_norm_case(c.tokens, c.d_model, no_liger, quack_norm),
        "rope": rope_case(c.tokens, c.d_model, c.num_heads, no_liger, quack_rotary),
        "silu_mul": swiglu_case(c.tokens, c.d_ff, no_liger),
    }
    cases: list[tuple[str, str, int, Callable[[], None]]] = []
    for op, case in glue.items():
        for impl in ("ours", "quack"):
            run = case.impls.get(impl)
            if run is None or isinstance(run, str):
                print(f"{op} {impl}: not profiled ({run or 'no such implementation'})", flush=True)
                continue

            def step(run=run) -> None:
                for leaf in run.leaves:
                    leaf.grad = None
                glue_step(run)

            cases.append((op, impl, case.nbytes, step))
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(c.tokens, c.d_model, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(c.vocab_size, c.d_model, device="cuda", generator=gen) / c.d_model**0.5).bfloat16()
    weight.requires_grad_()
    targets = torch.randint(0, c.vocab_size, (c.tokens,), device="cuda", generator=gen)

    def loss_step() -> None:
        hidden.grad = weight.grad = None
        fused_linear_cross_entropy(hidden, weight, targets).backward()

    cases.append(("linear_ce", "ours", 0, loss_step))
    return cases


def profile(order_path: Path) -> None:
    order = []
    for op, impl, nbytes, step in _cases():
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        step()
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        order.append({"op": op, "impl": impl, "bytes": nbytes})
        print(f"profiled {op} {impl}", flush=True)
    order_path.write_text(json.dumps(order, indent=1) + "\n")


# ncu's units, to ms, bytes and MHz.
SCALE = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "ns": 1e-6, "us": 1e-3, "ms": 1.0,
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "hz": 1e-6, "Khz": 1e-3, "Mhz": 1.0, "Ghz": 1e3}


def _number(text: str) -> float | None:
    """A raw-page value: '1,234.5', or '168 (168)' (the launch's value, then the requested one)."""
    try:
        return float(text.split(" (")[0].replace(",", ""))
    except ValueError:
        return None


def join(csv_path: Path, order_path: Path) -> list[dict]:
    """Rows from ncu's raw CSV (``ncu -i REPORT --page raw --csv``: a header, a units row, one row per kernel) and
    the order the cases ran in; each kernel's rows end at the case's marker kernel."""
    order = json.loads(order_path.read_text())
    with csv_path.open() as f:
        table = list(csv.reader(f))
    header, units, kernels = table[0], table[1], table[2:]
    col = {name: i for i, name in enumerate(header)}
    missing = [m for m in (*METRICS, "Kernel Name") if m not in col]
    if missing:
        raise ValueError(f"{csv_path} lacks the columns {missing}: was it exported with --page raw --csv?")
    rows: list[dict] = []
    case, per_case = 0, []
    for record in kernels:
        name = record[col["Kernel Name"]]
        if MARKER in name:
            if case >= len(order):
                raise ValueError(f"{csv_path} has more cases than {order_path} lists ({len(order)})")
            rows += _case_rows(order[case], per_case)
            case, per_case = case + 1, []
            continue
        row = {"kernel": name[:80]}
        for metric, field in METRICS.items():
            value = _number(record[col[metric]])
            unit = units[col[metric]].strip()
            if value is not None and field in ("ms", "sm_clock_mhz", "dram_read_bytes", "dram_write_bytes"):
                if unit not in SCALE:
                    raise ValueError(f"{metric}: unit {unit!r} not understood")
                value *= SCALE[unit]
            row[field] = value
        per_case.append(row)
    if case != len(order):
        raise ValueError(f"{csv_path} holds {case} marked cases, {order_path} lists {len(order)}")
    return rows


def _case_rows(case: dict, kernels: list[dict]) -> list[dict]:
    base = {"bench": "kernel_profile", "op": case["op"], "impl": case["impl"]}
    rows = []
    for k in kernels:
        moved = (k["dram_read_bytes"] or 0) + (k["dram_write_bytes"] or 0)
        rows.append({**base, **k, "dram_gbps": moved / k["ms"] / 1e6 if k["ms"] else None})
    total_ms = sum(k["ms"] for k in kernels)
    summary = {**base, "kernel": "all", "kernels": len(kernels), "ms": total_ms}
    if case["bytes"] and total_ms:
        summary.update(bytes=case["bytes"], gbps=case["bytes"] / total_ms / 1e6)
    return rows + [summary]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print-metrics", action="store_true", help="print the ncu metrics it reads, comma-separated")
    parser.add_argument("--order", type=Path, default=None, help="JSON of the cases in profiled order")
    parser.add_argument("--join", type=Path, default=None, metavar="CSV",
                        help="ncu's raw CSV of a profiled run: write its rows (with --out) instead of profiling")
    parser.add_argument("--out", type=Path, default=None, help="JSONL the joined rows are appended to")
    args = parser.parse_args()
    if args.print_metrics:
        print(",".join(METRICS))
        return
    if args.order is None:
        parser.error("--order is required to profile or to join")
    if args.join is None:
        if not torch.cuda.is_available():
            raise SystemExit("kernel_limits_profile.py profiles GPU kernels and needs a CUDA GPU")
        profile(args.order)
        return
    from cs336_harness.results import append_rows, provenance

    rows = join(args.join, args.order)
    for r in rows:
        if r["kernel"] == "all":
            rate = f", {r['gbps']:.0f} GB/s of must-move bytes" if "gbps" in r else ""
            print(f"{r['op']:>13} {r['impl']:>5}: {r['kernels']} kernels, {r['ms']:.3f} ms{rate}")
        else:
            print(f"{'':>20}{r['ms']:.3f} ms  DRAM {r['dram_pct']}% ({r['dram_gbps'] or 0:.0f} GB/s)  SM "
                  f"{r['sm_pct']}%  tensor {r['tensor_pct']}%  {r['sm_clock_mhz'] or 0:.0f} MHz  {r['kernel']}")
    if args.out:
        append_rows(args.out, rows, provenance(COMMAND.split()))


if __name__ == "__main__":
    main()
