"""Call s10b: what is alive at the allocator's peak of one leaderboard step (memory history of the second step), for
(1) ours at the config of test_gpu_allocator_peak_is_the_traced_peak (3 layers, attention:1, 8192 tokens), where the
allocator measured 0.34 GiB over the fake-tensor count, also counted with LiveMemory on the real tensors, and
(2) the strong baseline (FSDP2, compiled blocks) at first:7 and first:8, whose plan is 3.27 GiB over its measured
peaks. One JSON row per probe in $OUT/memprobe.jsonl."""
import json, os, time
from collections import defaultdict
import torch
import torch.distributed as dist
from cs336_harness.analysis.live_memory import LiveMemory
from cs336_harness.studies.leaderboard import PROXY_DEFAULTS, LeaderboardConfig, traced_peak
from cs336_harness.studies.leaderboard.config import RECIPES
from cs336_harness.studies.leaderboard.training import build_training, rank_batch

GIB = 2**30
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29561", rank=0, world_size=1, device_id=dev)


def frames(e, n):
    fs = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in e.get("frames", [])]
    ours = [f for f, raw in zip(fs, e.get("frames", [])) if any(s in raw["filename"] for s in
            ("cs336", "torchinductor", "autograd", "checkpoint", "fsdp", "_functional_collectives"))]
    return " <- ".join((ours or fs)[:n]) or "(no python frame)"


def probe(name, config, live_count=False):
    torch.cuda.empty_cache()
    tr = build_training(config, dev)
    x, y = rank_batch(config, 0, dev)
    tr.step(x, y)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    res = {"name": name, "checkpoint": str(tr.plan.policy), "expected_peak_gib": tr.plan.expected_peak_bytes / GIB}
    if live_count:
        with LiveMemory(sites=True) as live:
            tr.step(x, y)
        torch.cuda.synchronize()
        res["live_real_peak_gib"] = live.peak_bytes / GIB
        res["live_real_allocator_peak_gib"] = torch.cuda.max_memory_allocated(dev) / GIB
        res["live_real_sites"] = [[s.bytes / 2**20, s.count, s.what, s.where] for s in live.peak_sites()[:20]]
        torch.cuda.reset_peak_memory_stats(dev)
    torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    tr.step(x, y)
    torch.cuda.synchronize()
    res["allocator_peak_gib"] = torch.cuda.max_memory_allocated(dev) / GIB
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][0]
    live, cur, best = {}, 0, (-1, None, None)
    for idx, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e; cur += e["size"]
        elif e["action"] == "free_requested" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
        else:
            continue
        if cur > best[0]:
            best = (cur, idx, dict(live))
    groups = defaultdict(lambda: [0, 0])
    for e in best[2].values():
        k = frames(e, 4); groups[k][0] += e["size"]; groups[k][1] += 1
    at = trace[best[1]]
    res["traced_in_step_gib"] = best[0] / GIB  # allocations made in this step alive at its peak
    res["peak_event"] = {"size_mib": at["size"] / 2**20, "frames": frames(at, 10), "index": best[1], "of": len(trace)}
    res["alive_at_peak"] = sorted(([k, v[0] / 2**20, v[1]] for k, v in groups.items()), key=lambda r: -r[1])[:30]
    if config.impl == "ours" and config.num_layers <= 3:
        res["fake_traced_peak_gib"] = traced_peak(config).peak_bytes / GIB
    del tr
    torch.cuda.empty_cache()
    return res


ours = LeaderboardConfig(**{**PROXY_DEFAULTS, "backend": "nccl", "glue": "triton", "num_layers": 3,
                            "checkpoint": "attention:1", "context_length": 8192})
strong = {**PROXY_DEFAULTS, "backend": "nccl", "impl": "torch_native_compiled", **RECIPES["torch_native_compiled"]}
runs = [("ours 3 layers attention:1 8192", ours, True),
        ("strong first:7", LeaderboardConfig(**{**strong, "checkpoint": "first:7"}), False),
        ("strong first:8", LeaderboardConfig(**{**strong, "checkpoint": "first:8"}), False)]
with open(f"{os.environ['OUT']}/memprobe.jsonl", "w") as f:
    for name, cfg, lc in runs:
        t = time.time()
        try:
            r = probe(name, cfg, lc)
        except Exception as ex:  # one failed probe must not lose the others
            import traceback; traceback.print_exc()
            r = {"name": name, "error": repr(ex)[:2000]}
        r["wall_s"] = time.time() - t
        f.write(json.dumps(r) + "\n"); f.flush()
        print(json.dumps({k: v for k, v in r.items() if k not in ("alive_at_peak", "live_real_sites")})[:1500], flush=True)
dist.destroy_process_group()
