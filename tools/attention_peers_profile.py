"""Our attention, FlashAttention-4 and cuDNN kernel by kernel at one shape on a GPU (bf16, causal): what Nsight Compute
profiles in tools/gpu_attention_fa4.sh, and each implementation's kernels timed by torch.profiler.

For each implementation (the anchors part's names, cs336_harness.studies.attention.ANCHOR_IMPLS) one forward +
backward compiles and warms up, then one more runs: the launch that ``ncu -k regex:KERNEL -s 1 -c 1`` profiles (it
skips the warm-up's). With ``--out`` that second pass runs under torch.profiler instead, and one row per
(implementation, pass) records each kernel's time by name (``kernel_ms``, ms, the first 80 characters of the name)
and their sum (``kernel_total_ms``): what the main kernel and its helpers (zeroing, D = rowsum(dO * O), the dQ
pass) cost in each. FA4 runs where flash_attn.cute imports; elsewhere its rows say why (``note``).

``--case varlen`` runs the packed batch of ``cs336 attention --part varlen`` instead (its default documents: 32,768
tokens, 32 query and 8 key/value heads, d = 128; ``--shape`` unused; implementations ours, flex, sdpa_varlen, fa4);
``--case window`` a causal sliding window of ``--window`` keys at ``--shape`` (ours, fa4, flex), as its ``window`` part.

    bash tools/gpu.sh python3 tools/attention_peers_profile.py --impls ours,fa4,sdpa --out kernels.jsonl
    bash tools/gpu.sh ncu -k regex:_attn_bwd_kernel -s 1 -c 1 --set full -o bwd \\
        python3 tools/attention_peers_profile.py --impls ours
    bash tools/gpu.sh python3 tools/attention_peers_profile.py --case varlen --impls ours,fa4 --out kernels.jsonl
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from cs336_harness.commands._shared import attention_shape, csv_of
from cs336_harness.results import append_rows, provenance
from cs336_harness.studies.attention import ANCHOR_IMPLS, DETERMINISTIC_IMPLS, FA4_IMPLS, anchor_impl, fa4_attention
from cs336_harness.studies.attention_varlen import (
    VARLEN_IMPLS,
    WINDOW_IMPLS,
    VarlenBenchConfig,
    document_lengths,
    varlen_impl,
    window_impl,
)

# Per case, the implementations it runs, and those it runs when --impls is not given.
CASES = {"anchor": ANCHOR_IMPLS, "varlen": tuple(n for n in VARLEN_IMPLS if n != "ours_per_document"),
         "window": WINDOW_IMPLS}
DEFAULT_IMPLS = {"anchor": ("ours", "fa4", "sdpa"), "varlen": ("ours", "fa4"), "window": ("ours", "fa4")}


def _kernel_ms(prof: torch.profiler.profile) -> dict[str, float]:
    kernels: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:80]] += e.device_time / 1e3
    return dict(kernels)


def _inputs_and_fn(name: str, case: str, shape: tuple[int, int, int, int], window: int):
    """q, k, v (requiring grad), dO and the attention of implementation ``name`` for ``case``."""
    device = torch.device("cuda")
    if case == "varlen":
        cfg = VarlenBenchConfig()
        lengths = document_lengths(cfg.tokens, *cfg.doc_lengths, cfg.seed)
        shapes = [(cfg.tokens, h, cfg.head_dim) for h in (cfg.heads[0], cfg.heads[1], cfg.heads[1], cfg.heads[0])]
        fn = varlen_impl(name, lengths, device)
    else:
        shapes = [shape] * 4
        fn = window_impl(name, window, shape[2], device) if case == "window" else anchor_impl(name, shape[2], device)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(s, device=device, dtype=torch.bfloat16, generator=gen) for s in shapes)
    return (q.requires_grad_(), k.requires_grad_(), v.requires_grad_()), do, fn


def profile_impl(name: str, shape: tuple[int, int, int, int], timed: bool, case: str = "anchor",
                 window: int = 4096) -> list[dict]:
    """Warm-up and measured forward + backward of ``name`` in ``case`` (at ``shape`` but for ``varlen``); with
    ``timed``, the measured one's kernels."""
    (q, k, v), do, fn = _inputs_and_fn(name, case, shape, window)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(name in DETERMINISTIC_IMPLS)
    try:
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
    parser.add_argument("--case", choices=tuple(CASES), default="anchor",
                        help="a dense causal shape (default), the varlen part's packed batch, or a sliding window")
    parser.add_argument("--impls", type=csv_of(str), default=None,
                        help="comma list of the case's implementations (default ours,fa4,sdpa, or ours,fa4 for "
                             f"varlen and window; anchor: {','.join(ANCHOR_IMPLS)}; varlen: "
                             f"{','.join(CASES['varlen'])}; window: {','.join(WINDOW_IMPLS)})")
    parser.add_argument("--shape", type=attention_shape, default=(1, 32, 16384, 128), metavar="B,H,S,D")
    parser.add_argument("--window", type=int, default=4096, help="keys in the window (--case window)")
    parser.add_argument("--out", default=None, help="time the measured pass's kernels and append rows to this JSONL")
    args = parser.parse_args()
    args.impls = args.impls or DEFAULT_IMPLS[args.case]
    unknown = set(args.impls) - set(CASES[args.case])
    if unknown:
        parser.error(f"--impls must name implementations among {CASES[args.case]} for --case {args.case}, "
                     f"got {sorted(unknown)}")
    if args.window <= 0:
        parser.error(f"--window must be positive, got {args.window}")
    if not torch.cuda.is_available():
        raise SystemExit("attention_peers_profile.py times GPU kernels and needs a CUDA GPU")
    meta = provenance()
    batch, heads, seq, head_dim = args.shape
    if args.case == "varlen":
        cfg = VarlenBenchConfig()
        base = {"bench": "attention_kernels", "case": "varlen", "dtype": "bf16", "causal": True, "tokens": cfg.tokens,
                "heads": cfg.heads[0], "heads_kv": cfg.heads[1], "d": cfg.head_dim,
                "doc_lengths": document_lengths(cfg.tokens, *cfg.doc_lengths, cfg.seed)}
    else:
        base = {"bench": "attention_kernels", "dtype": "bf16", "causal": True, "batch": batch, "heads": heads,
                "seq": seq, "d": head_dim}
        if args.case == "window":
            base |= {"case": "window", "window": args.window}
    fa4_missing = fa4_attention()[1]
    for name in args.impls:
        if name in FA4_IMPLS and fa4_missing is not None:
            print(f"{name}: skipped, {fa4_missing}", flush=True)
            if args.out:
                append_rows(args.out, [{**base, "impl": name, "status": "skipped", "note": fa4_missing}], meta)
            continue
        rows = profile_impl(name, args.shape, timed=args.out is not None, case=args.case, window=args.window)
        for row in rows:
            top = sorted(row["kernel_ms"].items(), key=lambda kv: -kv[1])
            print(f"{name} {row['pass']}: {row['kernel_total_ms']:.3f} ms in kernels; "
                  + "; ".join(f"{ms:.3f} {kernel}" for kernel, ms in top), flush=True)
        if args.out:
            append_rows(args.out, [{**base, "impl": name, "status": "ok", **row} for row in rows], meta)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
