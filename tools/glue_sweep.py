"""The RMSNorm kernels' launch sweep (issue 44): every candidate launch of the forward and the backward kernel, for
the norm alone and with the residual add folded in, timed on one GPU at the leaderboard proxy's shape (32768 x 4096
bf16, bf16 weight), beside a copy of the same bytes.

A launch (``cs336_kernels.ops.rms_norm.Launch``) is rows per block, warps, programs per SM and pipeline stages. The
sweep compiles every candidate first in ``--jobs`` processes (filling Triton's disk cache), then:

1. times each candidate once (``pass`` 1: a short do_bench median, L2 flushed between calls), the norm and the
   folded add alike, the two directions' candidates in turns (cut short to end within ``--time-limit-s``);
2. times the ``--finalists`` fastest launches of each direction (by the sum of the two ops' times: both ops launch
   alike, which keeps add_rms_norm bit for bit the unfused add and norm) and the current default again,
   ``--repeats`` times in turns with a longer do_bench (``pass`` 2), beside a copy of each direction's bytes;
3. times the weight gradient's reduction alone for the numbers of partial sums that 1 to 4 programs per SM make.

Rows (one per timing, appended to ``--out`` with provenance): ``kernel`` (rms_norm or add_rms_norm), ``direction``
(fwd, bwd: the backward kernel and the reduction, as the operator runs them; dw_reduce), the launch's fields,
``programs``, ``ms``, ``gbps`` (bytes that must move / ms, as ``cs336 fused`` counts them), ``copy_gbps`` and
``vs_copy`` (pass 2), ``default`` (the launch is today's default); errors as ``error``. The last rows
(``bench = glue_sweep_best``) name the fastest launch of each direction in pass 2 and its time against the
default's: the defaults in ``launch_settings`` are set from them.

    bash tools/gpu.sh python3 tools/glue_sweep.py --time-limit-s 90 --out $OUT/glue_sweep.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from cs336_harness.results import append_rows, provenance
from cs336_kernels.ops.rms_norm import (
    Launch,
    launch_settings,
    num_programs,
    reduce_weight_grad,
    rms_norm_backward,
    rms_norm_forward,
)
from triton.testing import do_bench

EPS = 1e-5
DIRECTIONS = ("fwd", "bwd")
KERNELS = {"rms_norm": False, "add_rms_norm": True}  # name: the add folded in
# (rows per block, warps) at d = 4096: 8 to 64 values of a block per thread, none that spills (tests/sm90_builds.py
# builds the defaults; the backward's 4-row blocks spill at 8 and 16 warps).
SHAPES = {"fwd": ((1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16)),
          "bwd": ((1, 4), (1, 8), (1, 16), (2, 8), (2, 16))}
STAGES = (1, 2, 3, 4)
PROGRAMS_PER_SM = {"fwd": (1, 2, 4, 8), "bwd": (1, 2, 3, 4)}


def candidates(direction: str) -> list[Launch]:
    """Every launch the sweep times for ``direction`` (fwd or bwd)."""
    return [Launch(block_rows, warps, programs, stages)
            for (block_rows, warps), stages, programs in itertools.product(SHAPES[direction], STAGES,
                                                                           PROGRAMS_PER_SM[direction])]


@dataclass(frozen=True)
class Inputs:
    """The sweep's tensors: x, delta, dy, dh (rows, d) and w (d,); h = x + delta and the rstd of x and of h."""

    x: torch.Tensor
    delta: torch.Tensor
    dy: torch.Tensor
    dh: torch.Tensor
    w: torch.Tensor
    h: torch.Tensor
    rstd_x: torch.Tensor
    rstd_h: torch.Tensor


def make_inputs(rows: int, d: int, device: str) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(0)
    x, delta, dy, dh = (torch.randn(rows, d, generator=gen, device=device).bfloat16() for _ in range(4))
    w = (1 + 0.1 * torch.randn(d, generator=gen, device=device)).bfloat16()
    _, rstd_x, _ = rms_norm_forward(x, w, EPS)
    _, rstd_h, h = rms_norm_forward(x, w, EPS, delta)
    return Inputs(x, delta, dy, dh, w, h, rstd_x, rstd_h)


def step(t: Inputs, direction: str, add: bool, launch: Launch) -> Callable[[], Any]:
    """One launch of ``direction`` (the forward; the backward with its reduction) of the norm or the folded add."""
    if direction == "fwd":
        return lambda: rms_norm_forward(t.x, t.w, EPS, t.delta if add else None, launch=launch)
    saved, rstd, dh = (t.h, t.rstd_h, t.dh) if add else (t.x, t.rstd_x, None)
    return lambda: rms_norm_backward(t.dy, saved, t.w, rstd, dh, launch=launch)


def nbytes(direction: str, add: bool, rows: int, d: int, e: int, e_w: int) -> int:
    """Bytes that must move, as ``cs336_harness.studies.fused.block_glue`` counts each part."""
    if direction == "fwd":
        return (2 + 2 * add) * rows * d * e + 4 * rows + d * e_w
    return (3 + add) * rows * d * e + 4 * rows + 2 * d * e_w


_WORKER_INPUTS: dict[tuple[int, int, str], Inputs] = {}


def compile_one(key: tuple[str, bool, int, int, int], rows: int, d: int, device: str) -> str | None:
    """Compile (by running once at ``rows`` x ``d``, the proxy's specialisation) one (direction, add, block_rows,
    warps, stages); the error's text where it fails."""
    direction, add, block_rows, warps, stages = key
    if (rows, d, device) not in _WORKER_INPUTS:
        _WORKER_INPUTS[(rows, d, device)] = make_inputs(rows, d, device)
    try:
        step(_WORKER_INPUTS[(rows, d, device)], direction, add, Launch(block_rows, warps, 1, stages))()
    except Exception as e:  # noqa: BLE001 (a candidate that does not build is reported, not fatal)
        return f"{type(e).__name__}: {e}"
    return None


def precompile(launches: dict[str, list[Launch]], rows: int, d: int, jobs: int,
               device: str) -> dict[tuple[str, bool, int, int, int], str | None]:
    """Every distinct compilation of the candidates, in ``jobs`` processes (in this one with ``jobs`` = 0):
    {(direction, add, block_rows, warps, stages): error or None}."""
    keys = list(dict.fromkeys((direction, add, launch.block_rows, launch.num_warps, launch.stages)
                              for direction, listed in launches.items() for launch in listed
                              for add in KERNELS.values()))
    args = [(key, rows, d, device) for key in keys]
    if jobs:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            errors = pool.starmap(compile_one, args)
    else:
        errors = list(itertools.starmap(compile_one, args))
    return dict(zip(keys, errors, strict=True))


def do_bench_ms(fn: Callable[[], Any], rep_ms: int) -> float:
    return float(do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median"))


def _copy(nbytes_: int, device: str) -> Callable[[], Any]:
    src = torch.empty(nbytes_ // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def sweep(t: Inputs, timer: Callable[[Callable[[], Any], int], float], *, jobs: int, finalists: int, repeats: int,
          rep_ms: int, pass1_until: float, emit: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    """The three passes of the module docstring (pass 1 takes no new launch once ``time.monotonic()`` passes
    ``pass1_until``); every row goes to ``emit`` as it is made. Returns the best rows."""
    rows, d = t.x.shape
    device = t.x.device
    e, e_w = t.x.element_size(), t.w.element_size()
    base = {"bench": "glue_sweep", "shape": f"{rows}x{d}", "dtype": "bf16", "weight_dtype": "bf16"}
    launches = {direction: candidates(direction) for direction in DIRECTIONS}
    defaults = {direction: launch_settings(d, backward=direction == "bwd") for direction in DIRECTIONS}
    for direction, default in defaults.items():
        if default not in launches[direction]:
            launches[direction].append(default)
    built = precompile(launches, min(rows, 256), d, jobs, device.type)

    def row_of(direction: str, kernel: str, launch: Launch, pass_: int) -> dict[str, Any]:
        return {**base, "pass": pass_, "kernel": kernel, "direction": direction, **asdict(launch),
                "programs": num_programs(launch, rows, device), "default": launch == defaults[direction]}

    def timed(row: dict[str, Any], fn: Callable[[], Any], moved: int, rep: int) -> float:
        try:
            fn()
            row["ms"] = timer(fn, rep)
        except Exception as error:  # noqa: BLE001 (one failing candidate must not end the sweep)
            row["error"] = f"{type(error).__name__}: {error}"
            return float("inf")
        row["gbps"] = moved / (row["ms"] * 1e-3) / 1e9
        return row["ms"]

    # Pass 1 alternates the directions, so that a sweep cut short has timed some of both.
    order = [pair for pairs in itertools.zip_longest(*([(direction, launch) for launch in launches[direction]]
                                                        for direction in DIRECTIONS)) for pair in pairs if pair]
    first: dict[tuple[str, Launch], float] = {}
    for direction, launch in order:
        if time.monotonic() > pass1_until:
            emit({**base, "note": f"pass 1 stopped for time: {len(first)} of {len(order)} launches timed"})
            break
        total = 0.0
        for kernel, add in KERNELS.items():
            row = row_of(direction, kernel, launch, 1)
            error = built[(direction, add, launch.block_rows, launch.num_warps, launch.stages)]
            if error is not None:
                row["error"] = error
                total = float("inf")
            else:
                total += timed(row, step(t, direction, add, launch), nbytes(direction, add, rows, d, e, e_w), rep_ms)
            emit(row)
        first[(direction, launch)] = total
    best_rows = []
    for direction in DIRECTIONS:
        totals = {launch: ms for (dir_, launch), ms in first.items() if dir_ == direction}
        picked = [la for la in sorted(totals, key=totals.__getitem__)[:finalists] if totals[la] < float("inf")]
        if defaults[direction] not in picked:
            picked.append(defaults[direction])
        copies = {add: _copy(nbytes(direction, add, rows, d, e, e_w), device.type) for add in KERNELS.values()}
        calls: dict[tuple[Launch | None, str], list[float]] = {}
        for _ in range(repeats):
            for kernel, add in KERNELS.items():
                calls.setdefault((None, kernel), []).append(timer(copies[add], 4 * rep_ms))
                for launch in picked:
                    calls.setdefault((launch, kernel), []).append(timer(step(t, direction, add, launch), 4 * rep_ms))
        medians = {key: statistics.median(ms) for key, ms in calls.items()}
        for launch in picked:
            for kernel, add in KERNELS.items():
                moved = nbytes(direction, add, rows, d, e, e_w)
                ms, copy_ms = medians[(launch, kernel)], medians[(None, kernel)]
                emit({**row_of(direction, kernel, launch, 2), "ms": ms, "ms_calls": calls[(launch, kernel)],
                      "gbps": moved / (ms * 1e-3) / 1e9, "copy_gbps": moved / (copy_ms * 1e-3) / 1e9,
                      "vs_copy": copy_ms / ms})
        total = {launch: sum(medians[(launch, kernel)] for kernel in KERNELS) for launch in picked}
        best = min(picked, key=total.__getitem__)
        best_rows.append({**base, "bench": "glue_sweep_best", "direction": direction, **asdict(best),
                          **{f"{kernel}_ms": medians[(best, kernel)] for kernel in KERNELS},
                          **{f"default_{kernel}_ms": medians[(defaults[direction], kernel)] for kernel in KERNELS},
                          "vs_default": total[defaults[direction]] / total[best]})
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    for programs_per_sm in (1, 2, 3, 4):
        partial = torch.randn(programs_per_sm * sm_count, d, device=device)
        moved = partial.numel() * 4 + d * e_w
        row = {**base, "pass": 3, "kernel": "rms_norm", "direction": "dw_reduce", "programs": partial.shape[0]}
        timed(row, lambda partial=partial: reduce_weight_grad(partial, t.w.dtype), moved, rep_ms)
        emit(row)
    for row in best_rows:
        emit(row)
    return best_rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON-lines file the rows are appended to")
    parser.add_argument("--rows", type=int, default=32768, help="tokens (default 32768)")
    parser.add_argument("--d", type=int, default=4096, help="d_model (default 4096)")
    parser.add_argument("--jobs", type=int, default=14, help="processes compiling the candidates first (0: none)")
    parser.add_argument("--finalists", type=int, default=4, help="launches per direction timed again in pass 2")
    parser.add_argument("--repeats", type=int, default=3, help="pass 2's do_bench medians per launch, in turns")
    parser.add_argument("--rep-ms", type=int, default=30, help="pass 1's do_bench time (pass 2: four times it)")
    parser.add_argument("--time-limit-s", type=float, default=float("inf"),
                        help="pass 1 takes no new launch after this many seconds less 25 (passes 2 and 3)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("glue_sweep.py times GPU kernels; no CUDA device is visible")
    start = time.monotonic()
    meta = provenance()

    def emit(row: dict[str, Any]) -> None:
        append_rows(args.out, [row], meta)
        shown = {k: v for k, v in row.items() if k not in ("bench", "shape", "dtype", "weight_dtype", "ms_calls")}
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()), flush=True)

    best = sweep(make_inputs(args.rows, args.d, "cuda"), do_bench_ms, jobs=args.jobs, finalists=args.finalists,
                 repeats=args.repeats, rep_ms=args.rep_ms, pass1_until=start + args.time_limit_s - 25, emit=emit)
    for row in best:
        launch = Launch(row["block_rows"], row["num_warps"], row["programs_per_sm"], row["stages"])
        print(f"best {row['direction']}: {launch}, {row['vs_default']:.3f}x the default's speed", file=sys.stderr)
    print(f"glue_sweep: {time.monotonic() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
