"""Our attention, FlashAttention-4 and cuDNN kernel by kernel at one shape on a GPU (bf16, causal): what Nsight Compute
profiles in tools/gpu_attention_fa4.sh, and each implementation's kernels timed by torch.profiler.

For each implementation (the anchors part's names, cs336_harness.studies.attention.ANCHOR_IMPLS) one forward +
backward compiles and warms up, then one more runs: the launch that ``ncu -k regex:KERNEL -s 1 -c 1`` profiles (it
skips the warm-up's). With ``--out`` that second pass runs under torch.profiler instead, and one row per
(implementation, pass) records each kernel's time by name (``kernel_ms``, ms, the first 80 characters of the name)
and their sum (``kernel_total_ms``): what the main kernel and its helpers (zeroing, D = rowsum(dO * O), the dQ
pass) cost in each. FA4 runs where flash_attn.cute imports; elsewhere its rows say why (``note``).

    bash tools/gpu.sh python3 tools/attention_peers_profile.py --impls ours,fa4,sdpa --out kernels.jsonl
    bash tools/gpu.sh ncu -k regex:_attn_bwd_kernel -s 1 -c 1 --set full -o bwd \\
        python3 tools/attention_peers_profile.py --impls ours
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from cs336_harness.commands._shared import attention_shape, csv_of
from cs336_harness.results import append_rows, provenance
from cs336_harness.studies.attention import ANCHOR_IMPLS, DETERMINISTIC_IMPLS, FA4_IMPLS, anchor_impl, fa4_attention


def _kernel_ms(prof: torch.profiler.profile) -> dict[str, float]:
    kernels: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:80]] += e.device_time / 1e3
    return dict(kernels)


def profile_impl(name: str, shape: tuple[int, int, int, int], timed: bool) -> list[dict]:
    """Warm-up and measured forward + backward of ``name`` at ``shape``; with ``timed``, the measured one's kernels."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(name in DETERMINISTIC_IMPLS)
    try:
        fn = anchor_impl(name, shape[2], q.device)
        fn(q, k, v).backward(do)  # compiles
        torch.cuda.synchronize()
        q.grad = k.grad = v.grad = None
        if not timed:
            fn(q, k, v).backward(do)
            torch.cuda.synchronize()
            return []
        rows = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = fn(q, k, v)
            torch.cuda.synchronize()
        rows.append(("fwd", _kernel_ms(prof)))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out.backward(do)
            torch.cuda.synchronize()
        rows.append(("bwd", _kernel_ms(prof)))
    finally:
        torch.use_deterministic_algorithms(before)
    return [{"pass": p, "kernel_ms": kernels, "kernel_total_ms": sum(kernels.values())} for p, kernels in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", type=csv_of(str), default=("ours", "fa4", "sdpa"),
                        help=f"comma list of {','.join(ANCHOR_IMPLS)} (default ours,fa4,sdpa)")
    parser.add_argument("--shape", type=attention_shape, default=(1, 32, 16384, 128), metavar="B,H,S,D")
    parser.add_argument("--out", default=None, help="time the measured pass's kernels and append rows to this JSONL")
    args = parser.parse_args()
    unknown = set(args.impls) - set(ANCHOR_IMPLS)
    if unknown:
        parser.error(f"--impls must name implementations among {ANCHOR_IMPLS}, got {sorted(unknown)}")
    if not torch.cuda.is_available():
        raise SystemExit("attention_peers_profile.py times GPU kernels and needs a CUDA GPU")
    meta = provenance()
    batch, heads, seq, head_dim = args.shape
    base = {"bench": "attention_kernels", "dtype": "bf16", "causal": True, "batch": batch, "heads": heads, "seq": seq,
            "d": head_dim}
    fa4_missing = fa4_attention()[1]
    for name in args.impls:
        if name in FA4_IMPLS and fa4_missing is not None:
            print(f"{name}: skipped, {fa4_missing}", flush=True)
            if args.out:
                append_rows(args.out, [{**base, "impl": name, "status": "skipped", "note": fa4_missing}], meta)
            continue
        rows = profile_impl(name, args.shape, timed=args.out is not None)
        for row in rows:
            top = sorted(row["kernel_ms"].items(), key=lambda kv: -kv[1])
            print(f"{name} {row['pass']}: {row['kernel_total_ms']:.3f} ms in kernels; "
                  + "; ".join(f"{ms:.3f} {kernel}" for kernel, ms in top), flush=True)
        if args.out:
            append_rows(args.out, [{**base, "impl": name, "status": "ok", **row} for row in rows], meta)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
