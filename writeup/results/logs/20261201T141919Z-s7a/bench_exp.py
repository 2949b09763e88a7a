"""GPU: correctness and timing of the experimental Gluon backward variants against the production kernels."""
import json, os, sys, time
sys.path.insert(0, "scratch")
import torch
import torch.nn.functional as F
from triton.testing import do_bench
import gluon_bwd_exp as ex
from cs336_kernels.flash_attention.gluon_forward import gluon_attention_forward
from cs336_kernels.flash_attention.gluon_backward import gluon_attention_backward
from cs336_kernels.flash_attention.backward import flash_backward_triton
from cs336_kernels.flash_attention.reference import attention_reference

out = os.environ.get("OUT", "/tmp")
rows = []
VARIANTS = {
    "ld": dict(ld_smem=True),
    "ld_dq2": dict(ld_smem=True, dq_bufs=2),
    "ld_s3": dict(ld_smem=True, stages=3),
    "ld_s4": dict(ld_smem=True, stages=4),
}

def emit(row):
    row["call"] = os.environ.get("CS336_CALL_ID")
    print(json.dumps(row), flush=True)
    rows.append(row)

# correctness against float64 at small awkward shapes
torch.manual_seed(0)
for (b, hq, hkv, t, d) in [(2, 4, 2, 1000, 128), (2, 4, 2, 1000, 64), (1, 4, 4, 300, 128), (1, 2, 1, 4097, 64)]:
    q = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn_like(q)
    o, lse = gluon_attention_forward(q, k, v, True)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, is_causal=True)
    ref.backward(do.double())
    base = gluon_attention_backward(q, k, v, o, do, lse, True)
    for name, kw in [("prod", None)] + list(VARIANTS.items()):
        if kw is not None and kw.get("stages") == 4 and d == 128:
            continue
        if kw is not None and kw.get("stages") == 3 and d == 64:
            continue
        g = base if kw is None else ex.gluon_attention_backward_exp(q, k, v, o, do, lse, True, **kw)
        err = [((x.double() - r.grad).abs().max() / r.grad.abs().max()).item() for x, r in zip(g, (q64, k64, v64))]
        emit({"check": name, "shape": [b, hq, hkv, t, d], "rel_err_dq_dk_dv": err,
              "dkdv_equal_prod": bool(torch.equal(g[1], base[1]) and torch.equal(g[2], base[2]))})

def sdpa_bwd_ms(q, k, v, do):
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    fwd = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    def fb():
        F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).backward(do)
    return do_bench(fb, grad_to_none=[qs, ks, vs], return_mode="median") - do_bench(fwd, return_mode="median")

for (b, h, t, d) in [(1, 32, 32768, 128), (1, 16, 16384, 64), (4, 32, 4096, 128)]:
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    o, lse = gluon_attention_forward(q, k, v, True)
    fns = {"prod_gluon": lambda: gluon_attention_backward(q, k, v, o, do, lse, True),
           "triton": lambda: flash_backward_triton(q, k, v, o, do, lse, True)}
    for name, kw in VARIANTS.items():
        if (kw.get("stages") == 4 and d == 128) or (kw.get("stages") == 3 and d == 64):
            continue
        fns[name] = lambda kw=kw: ex.gluon_attention_backward_exp(q, k, v, o, do, lse, True, **kw)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    times["sdpa"] = []
    for _ in range(3):
        for name, fn in fns.items():
            times[name].append(do_bench(fn, warmup=50, rep=300, return_mode="median"))
        times["sdpa"].append(sdpa_bwd_ms(q, k, v, do))
    flops = 2.5 * 4 * b * h * t * t * d / 2
    for name, ms in times.items():
        med = sorted(ms)[1]
        emit({"bench": "bwd", "shape": [b, h, t, d], "impl": name, "bwd_ms": med, "runs": ms,
              "tflops_counted": flops / med / 1e9})
json.dump(rows, open(os.path.join(out, "bench_exp.json"), "w"), indent=1)
