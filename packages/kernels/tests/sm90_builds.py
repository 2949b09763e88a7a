"""Compile the RMSNorm (alone, with the residual add folded in, with Hugging Face's rounding, and its weight-gradient
reduction), RoPE (interleaved, and half-rotated at Llama-3.2-1B's heads) and SiLU-mul kernels and the Gluon attention
kernels for sm_90 without a GPU and print what ptxas made of them.

Each glue kernel is specialised as its launcher specialises it (default launches) at the leaderboard shapes (bf16,
d_model 4096, head_dim 128 with 32 heads; the SiLU-mul kernels do not specialise on d_ff; unit strides as constants,
16-divisible pointers and sizes) and built by ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``; the Gluon
attention kernels (forward and backward, causal, at each head dim they take, and packed at d = 96 and 256) as
:func:`cs336_kernels.sass.gluon_attention_build` builds them, which is how a Triton whose Gluon API changed is caught
without an H100. cuobjdump then reads registers per thread, the local-memory spill stores and loads, and the wgmma
and TMA load instructions in the SASS. One JSON row per build on stdout::

    uv run python packages/kernels/tests/sm90_builds.py

Run it without TRITON_INTERPRET (the interpreter cannot compile); ``test_sm90_builds.py`` runs it in a
subprocess.
"""

from __future__ import annotations

import json
from typing import Any

import triton
import triton.backends.nvidia
from cs336_kernels.ops import rms_norm, rope, swiglu
from cs336_kernels.ops.flash_attention.gluon_common import HEAD_DIMS
from cs336_kernels.sass import gluon_attention_build, read_build
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def resources(name: str, compiled: Any) -> dict:
    """What ptxas made of one build: registers, stack, shared memory, spills, wgmma and TMA loads."""
    build = read_build(compiled)
    sass = build.sass
    return {"kernel": name, "target": "sm_90", "num_warps": compiled.metadata.num_warps,
            "registers": build.registers, "stack_bytes": build.stack_bytes,
            "shared_bytes": compiled.metadata.shared, "spill_stores": sass.count("STL"),
            "spill_loads": sass.count("LDL"), "wgmma": sass.count("HGMMA"), "tma_loads": sass.count("UTMALDG"),
            "sass_lines": sass.count("\n")}


def build(name: str, kernel: Any, types: dict[str, str], constants: dict[str, Any], num_warps: int) -> dict:
    """Compile ``kernel`` with the given argument types (the rest constexpr) and read its resources."""
    signature = {arg: types.get(arg, "constexpr") for arg in kernel.arg_names}
    missing = set(kernel.arg_names) - set(types) - set(constants)
    assert not missing, f"{name}: no type or constant for {sorted(missing)}"
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(kernel.arg_names)
             if signature[arg].startswith("*") or signature[arg] == "i32"}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=TARGET, options={"num_warps": num_warps})
    return resources(name, compiled)


def rows() -> list[dict]:
    d_model, head_dim, heads = 4096, 128, 32
    out = []
    block_d = triton.next_power_of_2(d_model)
    # The norm alone (no delta, h, dh: None), with the residual add folded in, and with HF's rounding (bf16 weight).
    variants = [(w, add, False) for w in ("bf16", "fp32") for add in (False, True)] + [("bf16", False, True)]
    for w, add, cast_first in variants:
        name = "add_rms_norm" if add else "rms_norm_hf" if cast_first else "rms_norm"
        fwd_add, bwd_add = ({"DELTA": "*bf16", "H": "*bf16"}, {"DH": "*bf16"}) if add else ({}, {})
        for direction, backward in (("fwd", False), ("bwd", True)):
            launch = rms_norm.launch_settings(d_model, backward=backward)
            constants = {"BLOCK_ROWS": launch.block_rows, "BLOCK_D": block_d, "STAGES": launch.stages, "ADD": add,
                         "CAST_FIRST": cast_first}
            if backward:
                kernel, types = rms_norm._rms_norm_bwd_kernel, {
                    "DY": "*bf16", "X": "*bf16", "W": f"*{w}", "RSTD": "*fp32", "DX": "*bf16",
                    "DW_PARTIAL": "*fp32", "stride_dy": "i32", "stride_dh": "i32", "stride_x": "i32",
                    "n_rows": "i32", "D": "i32", "offset": "fp32", **bwd_add}
                constants |= {} if add else {"DH": None}
            else:
                kernel, types = rms_norm._rms_norm_fwd_kernel, {
                    "X": "*bf16", "W": f"*{w}", "Y": "*bf16", "RSTD": "*fp32", "stride_x": "i32",
                    "stride_delta": "i32", "n_rows": "i32", "D": "i32", "eps": "fp32", "offset": "fp32",
                    **fwd_add}
                constants |= {} if add else {"DELTA": None, "H": None}
            row = build(f"{name}_{direction} (weight {w})", kernel, types, constants, launch.num_warps)
            out.append({**row, "programs_per_sm": launch.programs_per_sm})
    out.append(build("rms_norm_dw_reduce (weight bf16)", rms_norm._dw_reduce_kernel,
                     {"PARTIAL": "*fp32", "DW": "*bf16", "n_partials": "i32", "D": "i32"},
                     {"BLOCK_P": rms_norm._REDUCE_PARTIALS, "BLOCK_N": rms_norm._REDUCE_COLUMNS}, 4))
    # RoPE: the 8B model's interleaved pairs from fp32 tables at positions, and Llama-3.2-1B's half-rotated pairs
    # (HF: 32 query and 8 key heads of 64) from per-token bf16 angles.
    strides = ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_ct", "S", "HQ",
               "HK")
    for layout, (dim, heads_q, heads_k, table, half) in {"": (head_dim, heads, heads, "fp32", False),
                                                         "half ": (64, 32, 8, "bf16", True)}.items():
        settings = rope.launch_settings(dim, heads_q, heads_k)
        rope_warps = settings.pop("num_warps")
        types = {"Q": "*bf16", "K": "*bf16", "QO": "*bf16", "KO": "*bf16", "COS": f"*{table}", "SIN": f"*{table}",
                 **{s: "i32" for s in strides}}
        if half:  # per-token angles, one row per token of a batch row; no positions
            types["stride_cb"] = "i32"
            layout_constants = {"POS": None, "stride_pb": 0, "stride_ps": 0}
        else:  # tables shared by the batch, rows at the positions
            types |= {"POS": "*i64", "stride_pb": "i32"}
            layout_constants = {"stride_cb": 0, "stride_ps": 1}
        for inverse in (False, True):
            out.append(build(f"rope {layout}({'backward' if inverse else 'forward'})", rope._rope_kernel, types,
                             {"stride_cf": 1, "D": dim, "ROTARY": dim, "HALF": half, "HAS_POSITIONS": not half,
                              "INVERSE": inverse, "BLOCK_HALF": triton.next_power_of_2(dim // 2), **layout_constants,
                              **settings}, rope_warps))
    out.append(build("silu_mul_fwd", swiglu._silu_mul_fwd_kernel,
                     {"A": "*bf16", "B": "*bf16", "OUT": "*bf16", "stride_a": "i32", "stride_b": "i32", "N": "i32",
                      "numel": "i32"},
                     {"BLOCK": swiglu._BLOCK, "ROW_STRIDED": False}, swiglu._NUM_WARPS))
    out.append(build("silu_mul_bwd", swiglu._silu_mul_bwd_kernel,
                     {"DOUT": "*bf16", "A": "*bf16", "B": "*bf16", "DA": "*bf16", "DB": "*bf16", "stride_dout": "i32",
                      "stride_a": "i32", "stride_b": "i32", "N": "i32",
                      "numel": "i32"},
                     {"BLOCK": swiglu._BLOCK, "ROW_STRIDED": False}, swiglu._NUM_WARPS))
    for direction, name in (("fwd", "forward"), ("bwd", "backward")):
        for head_dim in HEAD_DIMS[name]:
            compiled, _ = gluon_attention_build(direction, head_dim, is_causal=True)
            out.append(resources(f"gluon_{direction} (d {head_dim}, causal)", compiled))
    for direction, head_dim in (("fwd", 96), ("fwd", 256), ("bwd", 96)):
        compiled, _ = gluon_attention_build(direction, head_dim, is_causal=True, packed=True)
        out.append(resources(f"gluon_{direction} (d {head_dim}, causal, packed)", compiled))
    return out


if __name__ == "__main__":
    for row in rows():
        print(json.dumps(row))
