"""Reading what ptxas built for a GPU, offline: the cuobjdump that ships with Triton, and spills per main loop.

Offline sm_90 builds (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, no GPU needed) are how the kernels'
register pressure is checked before a GPU run, and how the Gluon attention kernels are checked to build under each
Triton the package supports (:func:`gluon_attention_build`); :func:`cuobjdump` prints their resource usage and SASS,
:func:`loop_spills` counts the local-memory traffic inside the loops that run once per tile and :func:`loop_opcodes`
chosen instructions (barriers, multiplies) there.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def cuobjdump() -> str:
    """The cuobjdump on PATH, else the one bundled with Triton."""
    import triton.backends.nvidia

    bundled = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    found = shutil.which("cuobjdump") or (str(bundled) if bundled.exists() else None)
    if found is None:
        raise RuntimeError("cuobjdump not found (neither on PATH nor bundled with Triton)")
    return found


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


_BRANCH = re.compile(r"\bBRA\s+(0x[0-9a-f]+)")


def _innermost_mma_loops(sass: str) -> list[list[str]]:
    # The instructions of each innermost loop with wgmma in it, in SASS order. A loop is the address range from a
    # predicated backward branch's target to the branch; unpredicated backward branches are returns from
    # out-of-line code such as mbarrier wait retries.
    code = [(int(m[1], 16), m[2]) for m in _SASS_LINE.finditer(sass)]
    ranges = {(int(b[1], 16), addr) for addr, text in code
              if text.startswith("@") and (b := _BRANCH.search(text)) and int(b[1], 16) <= addr}
    body = {r: [text for addr, text in code if r[0] <= addr <= r[1]] for r in ranges}
    with_mma = [r for r in sorted(ranges) if any("HGMMA" in text for text in body[r])]
    innermost = [r for r in with_mma if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in with_mma)]
    return [body[r] for r in innermost]


def loop_spills(sass: str) -> list[list[int]]:
    """[spill stores, spill loads, instructions] of each innermost loop with wgmma in it, in SASS order.

    Whole-kernel spill counts mix the main loops with code that runs once per program; only spills inside the
    loops cost per tile.
    """
    return [[sum("STL" in t for t in body), sum("LDL" in t for t in body), len(body)]
            for body in _innermost_mma_loops(sass)]


_GUARD = re.compile(r"^@!?U?P\w+\s+")


def loop_opcodes(sass: str, opcodes: Sequence[str]) -> list[dict[str, int]]:
    """For each innermost loop with wgmma in it (as :func:`loop_spills` finds them), how many of its instructions
    start with each of ``opcodes`` (a predicate guard aside): ``BAR.SYNC`` counts barriers, ``SYNCS.PHASECHK``
    mbarrier waits, ``FMUL`` multiplies, each once per pass through the loop's code (a branch may skip some)."""
    loops = []
    for body in _innermost_mma_loops(sass):
        bare = [_GUARD.sub("", text) for text in body]
        loops.append({op: sum(t.startswith(op) for t in bare) for op in opcodes})
    return loops


@dataclass(frozen=True)
class Build:
    """What ptxas made of one compiled kernel: registers per thread, stack frame bytes, and its SASS."""

    registers: int | None
    stack_bytes: int | None
    sass: str


def gluon_attention_build(direction: str, head_dim: int, is_causal: bool, deterministic: bool = False,
                          packed: bool = False) -> tuple[Any, dict[str, Any]]:
    """The Gluon attention kernel of ``direction`` (``"fwd"``, or ``"bwd"`` in its default or ``deterministic``
    mode) compiled for sm_90 as its launcher calls it (bf16, 4 query heads on 2 key/value heads, 1,024 rows, its
    own argument list and launch options; ``packed``: the rows as two packed sequences of 300 and 724), and the
    constexprs it was compiled with. Needs no GPU."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from cs336_kernels.ops.flash_attention import gluon_backward, gluon_forward
    from cs336_kernels.ops.flash_attention.gluon_common import MAX_REGISTERS
    from cs336_kernels.ops.flash_attention.params import make_params

    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    q = torch.zeros(1, 4, 1024, head_dim, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 1024, head_dim, dtype=torch.bfloat16)
    lse = torch.zeros(1, 4, 1024)
    params = make_params(head_dim, is_causal, None, (-1, -1), 0.0)
    offsets = None
    if packed:
        cu_seqlens = torch.tensor([0, 300, 1024], dtype=torch.int32)
        params = make_params(head_dim, is_causal, None, (-1, -1), 0.0, True, cu_seqlens, cu_seqlens, 724, 724)
        offsets = torch.zeros(3, dtype=torch.int32)  # the tile queue (forward) or padded starts (backward): a pointer
    if direction == "fwd":
        kernel = gluon_forward._attn_fwd_kernel
        args, constants = gluon_forward.forward_args(q, k, k, q, lse, torch.zeros(1, dtype=torch.int32), params,
                                                     offsets)
    else:
        kernel = gluon_backward._attn_bwd_kernel
        locks = torch.zeros(1, dtype=torch.int32) if deterministic else None
        args, constants = gluon_backward.backward_args(q, k, k, q, lse, lse, q.float(), k, k, locks, params, offsets)
    names = kernel.arg_names
    signature = {name: "constexpr" if name in constants else mangle_type(arg)
                 for name, arg in zip(names, [*args, *constants.values()], strict=True)}
    # The launcher's pointers come from fresh allocations, 16-byte aligned.
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in names if signature[name].startswith("*")}
    source = GluonASTSource(kernel, signature, constants, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "maxnreg": MAX_REGISTERS})
    return compiled, constants


def read_build(compiled: Any) -> Build:
    """Resource usage and SASS of a ``triton.compile`` result, read from its cubin with :func:`cuobjdump`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump(), "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([cuobjdump(), "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return Build(int(found[1]) if found else None, int(found[2]) if found else None, sass)
