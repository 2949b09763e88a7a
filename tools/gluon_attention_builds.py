"""Offline sm_90 builds of the Gluon attention kernels (no GPU needed): registers, spills, wgmma and TMA counts.

Each kernel is compiled as its launcher would call it (bf16, GQA, the launcher's own argument list; a dense batch,
causal or not, and a packed causal one) for GPUTarget("cuda", 90, 32), and its SASS is read with the cuobjdump bundled
with Triton. ``max_register`` is the highest register the SASS names (the partitions raise their budget with
setmaxnreg, so the launch value says little); ``loops`` is spill stores + loads (instructions) per main-loop body, as
in ``cs336_harness.studies.attention_tuning``; ``loop_ops`` counts chosen instructions per main-loop body: wgmma and
its waits, warpgroup barriers (``BAR.SYNC``), mbarrier waits and arrives, memory fences, and the fp32 multiplies,
FMAs and exp2 of the softmax (those of a masked branch included).

    uv run python tools/gluon_attention_builds.py --out writeup/results/gluon_attention.jsonl
"""

from __future__ import annotations

import argparse
import re

from cs336_harness.results import append_rows, provenance
from cs336_kernels.ops.flash_attention.gluon_common import HEAD_DIMS
from cs336_kernels.sass import gluon_attention_build, loop_opcodes, loop_spills, read_build

LOOP_OPCODES = ("HGMMA", "WARPGROUP.DEPBAR", "BAR.SYNC", "SYNCS.PHASECHK", "SYNCS.ARRIVE", "MEMBAR", "FMUL", "FFMA",
                "MUFU.EX2")


def build_row(name: str, head_dim: int, is_causal: bool, deterministic: bool = False, packed: bool = False) -> dict:
    """Compile the ``name`` (fwd or bwd, the latter in its default or deterministic mode) kernel at ``head_dim``
    for a dense or a ``packed`` batch and count what its SASS holds."""
    compiled, constants = gluon_attention_build(name, head_dim, is_causal, deterministic, packed)
    sass = read_build(compiled).sass
    return {"bench": "gluon_build", "kernel": name, "d": head_dim, "dtype": "bf16", "causal": is_causal,
            "deterministic": deterministic, "packed": packed,
            "config": [constants["BLOCK_M"], constants["BLOCK_N"], constants["STAGES"]], "target": "sm_90",
            "max_register": max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)),
            "shared_bytes": compiled.metadata.shared, "spill_stores": sass.count("STL"),
            "spill_loads": sass.count("LDL"), "wgmma": sass.count("HGMMA"), "tma_loads": sass.count("UTMALDG"),
            "tma_stores": sass.count("UTMASTG"), "tma_reduce_adds": sass.count("UTMAREDG"),
            "loops": loop_spills(sass), "loop_ops": loop_opcodes(sass, LOOP_OPCODES)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="append rows (with provenance) to this JSONL file")
    args = parser.parse_args()
    meta = provenance()
    for name, deterministic in (("fwd", False), ("bwd", False), ("bwd", True)):
        for head_dim in HEAD_DIMS["forward" if name == "fwd" else "backward"]:
            for is_causal, packed in ((False, False), (True, False), (True, True)):
                row = build_row(name, head_dim, is_causal, deterministic, packed)
                print(" ".join(f"{key}={value}" for key, value in row.items()), flush=True)
                if args.out:
                    append_rows(args.out, [row], meta)


if __name__ == "__main__":
    main()
