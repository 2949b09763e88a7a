"""Wide autotuning sweep for our FlashAttention-2 kernels, then ours vs SDPA.

The kernels in :mod:`cs336_kernels.ops.flash_attention` autotune over a short pruned list of
(BLOCK_M, BLOCK_N, num_warps, num_stages) per regime (dtype width, padded head dim), so that a cold
start stays fast. This sweep widens those lists with :data:`CANDIDATES` (bf16/fp16 at d = 64 and 128,
through :func:`cs336_kernels.ops.flash_attention.tuning.extra_configs`), lets the autotuner time every
candidate at the real shapes and records:

- one ``bench = "tune"`` row per (shape, kernel, candidate) with the autotuner's median (a short
  ``do_bench``, so a guide for pruning, not a result);
- ``bench = "variants"`` rows: ``do_bench`` medians of forward, backward and forward+backward of SDPA
  and ours (``triton``) in one process, with the winning config of each kernel.

The short lists in ``cs336_kernels/ops/flash_attention/tuning.py`` are then edited from the ``tune`` rows,
and the final numbers come from ``cs336 attention --part anchors`` on the committed lists. Run on the
GPU machine (``cs336 tune``, :mod:`cs336_harness.commands.tune`)::

    bash tools/gpu.sh python3 -m cs336_harness.cli tune --out $OUT/attention_tuning.jsonl

``--builds`` needs no GPU: it compiles each kernel (bf16, causal, d = 64, 128 and 256) for sm_90 with every
listed and candidate config and records what ptxas and the SASS say (``bench = "build"`` rows: registers
per thread, stack frame bytes, and static counts in the SASS of local-memory spill stores and loads,
of wgmma, mma.sync and TMA-load instructions, and spill stores, loads and instructions per main loop)::

    uv run cs336 tune --builds --out writeup/results/attention_builds.jsonl
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from cs336_kernels import flash_attention
from cs336_kernels.ops.flash_attention.tuning import (
    KERNELS,
    TMA_FLAGS,
    Entry,
    Regime,
    autotuned_kernel,
    extra_configs,
    listed_configs,
)
from cs336_kernels.sass import loop_spills, read_build

from cs336_harness.progress import progress_bar
from cs336_harness.results import append_rows, provenance
from cs336_harness.studies.attention import AttentionBenchConfig, flash_rows, warm_kernels

# Extra candidates per kernel and (bytes per element, padded head dim). The forward and dQ kernels need
# BLOCK_N | BLOCK_M, the dK/dV kernels BLOCK_M | BLOCK_N.
CANDIDATES: dict[str, dict[Regime, list[Entry]]] = {
    "fwd": {
        (2, 64): [(128, 64, 4, 4), (128, 128, 8, 4), (256, 64, 8, 3), (64, 64, 4, 3)],
        (2, 128): [(128, 128, 8, 3), (128, 64, 8, 4), (256, 64, 8, 2)],
    },
    "dkdv": {
        (2, 64): [(32, 128, 8, 3), (64, 128, 8, 1), (32, 128, 8, 2), (64, 64, 8, 2)],
        (2, 128): [(32, 128, 8, 1), (64, 64, 8, 1), (32, 128, 8, 2)],
    },
    "dq": {
        (2, 64): [(128, 128, 8, 3), (64, 64, 4, 4), (128, 64, 8, 4)],
        (2, 128): [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    },
}
SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (1, 32, 32768, 128), (1, 16, 16384, 64), (1, 16, 16384, 128), (2, 16, 8192, 64),
)
IMPLS = ("sdpa", "triton")


def _warm_wide(shape: tuple[int, int, int, int], dtype_name: str) -> None:
    with extra_configs(CANDIDATES):
        warm_kernels(shape, dtype_name)


def _entry(config: Any) -> list[int | str]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), and last the lower-cased TMA flag ("kv_tma" in the forward
    and dQ kernels, "qdo_tma" in the dK/dV kernel) for a config whose main loop loads by TMA."""
    entry: list[int | str] = [config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages]
    return entry + [flag.lower() for flag in sorted(set(TMA_FLAGS.values())) if config.kwargs.get(flag)]


def _tune_rows(shape: tuple[int, int, int, int]) -> Iterator[dict[str, Any]]:
    """Run forward+backward once (autotuning anything new) and report every kernel it just tuned."""
    kernels = {name: autotuned_kernel(name) for name in KERNELS}
    before = {name: id(getattr(k, "configs_timings", None)) for name, k in kernels.items()}
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    flash_attention(q, k, v, is_causal=True).sum().backward()
    torch.cuda.synchronize()
    for name, kernel in kernels.items():
        timings = getattr(kernel, "configs_timings", None)
        if timings is None or id(timings) == before[name]:
            continue
        for config, (median, p20, p80) in sorted(timings.items(), key=lambda item: item[1][0]):
            yield {"bench": "tune", "kernel": name, "batch": shape[0], "heads": shape[1], "seq": shape[2],
                   "d": shape[3], "dtype": "bf16", "config": _entry(config), "ms": median, "p20_ms": p20,
                   "p80_ms": p80, "best": config is kernel.best_config}


def run_tuning(shapes: Sequence[tuple[int, int, int, int]], rep_ms: int, out: str | None,
               precompile_jobs: int, progress: bool = False) -> list[dict[str, Any]]:
    """The ``tune`` and ``variants`` rows for ``shapes`` (bf16, causal); each row is appended as it comes. With
    ``progress``, a bar on stderr counts the shapes done."""
    meta = provenance()
    bar = progress_bar(total=len(shapes), desc="tune", enabled=progress, unit="shape")
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        if out:
            append_rows(out, [row], meta)

    if precompile_jobs:
        bar.set_postfix_str("compiling the candidates")
        jobs = [((b, h, 256, d), "bf16") for b, h, _, d in shapes]
        with multiprocessing.get_context("spawn").Pool(precompile_jobs) as pool:
            pool.starmap(_warm_wide, list(dict.fromkeys(jobs)))
    cfg = AttentionBenchConfig(parts=("anchors",), anchor_rep_ms=rep_ms)
    with extra_configs(CANDIDATES):
        for shape in shapes:
            bar.set_postfix_str("x".join(map(str, shape)))
            for row in _tune_rows(shape):
                emit(row)
            for row in flash_rows(shape, "bf16", IMPLS, rep_ms, cfg, "variants"):
                if row["impl"] == "triton":
                    # The configs of the row's last launches (its forward+backward timing), per kernel.
                    row["configs"] = {name: _entry(autotuned_kernel(name).best_config) for name in KERNELS}
                emit(row)
            bar.update()
    bar.close()
    return rows


_BF16_POINTERS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}
_UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_dod", "stride_dkd", "stride_dvd",
                 "stride_dqd"}


def build_row(name: str, head_dim: int, entry: Entry, tma: bool = False) -> dict[str, Any]:
    """Compile one kernel for sm_90 as the launcher would specialise it (bf16, a dense batch, no softcap, unit d
    stride, 16-divisible sizes) and read its resources; ``name`` is fwd, dkdv or dq; ``tma`` sets the kernel's TMA
    flag (``TMA_FLAGS``: K and V by TMA in the forward and dQ kernels, Q and dO in the dK/dV kernel)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = autotuned_kernel(name).fn
    block_m, block_n, num_warps, num_stages = entry
    constants: dict[str, Any] = {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "EVEN_D": True, "SOFTCAP": False,
                                 "WINDOW": False, "VARLEN": False, "CU_Q": None, "CU_K": None,
                                 "DOT_PRECISION": "tf32", "BLOCK_M": block_m, "BLOCK_N": block_n,
                                 TMA_FLAGS[name]: tma}
    constants |= {arg: 1 for arg in _UNIT_STRIDES & set(fn.arg_names)}
    signature = {}
    for arg in fn.arg_names:
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg in _BF16_POINTERS:
            signature[arg] = "*bf16"
        elif arg in ("L", "DELTA"):
            signature[arg] = "*fp32"
        else:
            signature[arg] = "fp32" if arg in ("qk_scale", "sm_scale", "softcap_in", "softcap_out") else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
             if signature[arg] in ("*bf16", "*fp32", "i32")}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    build = read_build(compiled)
    sass = build.sass
    return {"bench": "build", "kernel": name, "d": head_dim, "dtype": "bf16",
            "config": list(entry) + ([TMA_FLAGS[name].lower()] if tma else []),
            "target": "sm_90", "registers": build.registers,
            "stack_bytes": build.stack_bytes, "shared_bytes": compiled.metadata.shared,
            "spill_stores": sass.count("STL"), "spill_loads": sass.count("LDL"), "wgmma": sass.count("HGMMA"),
            "mma_sync": sass.count("HMMA"), "tma_loads": sass.count("UTMALDG"), "loops": loop_spills(sass)}


def build_rows(out: str | None, progress: bool = False) -> list[dict[str, Any]]:
    """:func:`build_row` for every listed and candidate config of the 16-bit d = 64, 128 and 256 regimes; with
    ``progress``, a bar on stderr counts the builds done."""
    meta = provenance()
    builds = []
    for name in KERNELS:
        table, tma_table = listed_configs(name), listed_configs(name, tma=True)
        for head_dim in (64, 128, 256):
            entries = dict.fromkeys([*table[(2, head_dim)], *CANDIDATES[name].get((2, head_dim), [])])
            builds += [(name, head_dim, entry, False) for entry in entries]
            builds += [(name, head_dim, entry, True) for entry in tma_table.get((2, head_dim), [])]
    bar = progress_bar(total=len(builds), desc="tune --builds", enabled=progress, unit="build")
    rows = []
    for name, head_dim, entry, tma in builds:
        bar.set_postfix_str(f"{name} d={head_dim}")
        row = build_row(name, head_dim, entry, tma)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
        if out:
            append_rows(out, [row], meta)
        bar.update()
    bar.close()
    return rows
