"""Offline sm_90 builds (no GPU): the RMSNorm (alone, with the residual add folded in, with HF's rounding), RoPE (both
layouts) and SiLU-mul kernels lower, spill nothing, and keep the resources their launchers assume; the Gluon attention
kernels build under the installed Triton, with wgmma and TMA."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import triton.backends.nvidia

_PTXAS = shutil.which("ptxas") or (Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas").exists()


@pytest.mark.slow
@pytest.mark.skipif(not _PTXAS, reason="needs ptxas (on PATH or bundled with Triton)")
def test_kernels_build_for_sm90():
    # The test session runs Triton's interpreter, which cannot compile; the builds run in a fresh process.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_builds.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
    rows = {row["kernel"]: row for row in map(json.loads, done.stdout.strip().splitlines())}
    assert len(rows) == 27
    gluon = {name: row for name, row in rows.items() if name.startswith("gluon_")}
    # Forward at d 64, 96, 128, 256, backward at d 64, 96, 128; packed batches at the head dims whose tiles are
    # wider than d (96) or whose O leaves from registers (256).
    assert len(gluon) == 10
    for name, row in rows.items():
        if name in gluon:
            # Spills in these depend on the Triton release (writeup/results/gluon_attention.jsonl has the builds
            # under the workspace's); what must hold under every one is that the Hopper paths are there, in the
            # 227 KiB of shared memory an sm_90 block may have.
            assert row["wgmma"] > 0 and row["tma_loads"] > 0, (name, row)
            assert row["shared_bytes"] <= 227 * 1024, (name, row)
        else:
            assert row["spill_stores"] == row["spill_loads"] == row["stack_bytes"] == 0, (name, row)
    # The RMSNorm kernels' default launches put programs_per_sm programs on each SM at once: their registers (allocated
    # in units of 8 per thread) and shared memory (the pipeline's buffers, plus 1 KiB the SM reserves per program)
    # fit an SM of sm_90 (65,536 registers, 228 KiB) that many times.
    for name, weights in (("rms_norm", ("bf16", "fp32")), ("add_rms_norm", ("bf16", "fp32")),
                          ("rms_norm_hf", ("bf16",))):
        for direction in ("fwd", "bwd"):
            for weight in weights:
                row = rows[f"{name}_{direction} (weight {weight})"]
                programs, threads = row["programs_per_sm"], 32 * row["num_warps"]
                assert programs * threads * -(-row["registers"] // 8) * 8 <= 65536, row
                assert programs * (row["shared_bytes"] + 1024) <= 228 * 1024, row
    # RoPE's pair split and join stay in registers: no shared-memory layout conversion.
    assert all(rows[f"rope {layout}({direction})"]["shared_bytes"] == 0 for layout in ("", "half ")
               for direction in ("forward", "backward"))
