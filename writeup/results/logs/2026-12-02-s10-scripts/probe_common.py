"""What is alive at the allocator's peak of one call (memory history): shared by the s10c probes."""
import os
from collections import defaultdict
import torch

KEYS = ("cs336", "torchinductor", "autograd", "checkpoint", "fsdp", "triton", "baselines")


def _frames(e, n):
    raw = e.get("frames", [])
    fs = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in raw]
    ours = [s for s, f in zip(fs, raw) if any(k in f["filename"] for k in KEYS)]
    return " <- ".join((ours or fs)[:n]) or "(no python frame)"


def peak_of(fn, stacks="python"):
    """Run fn() under memory history; return (allocator peak GiB, what was alive at the peak of what fn allocated)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=3_000_000, **(dict(context=None) if stacks == "none" else dict(stacks=stacks)))
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    live, cur, best = {}, 0, (-1, 0, {})
    for idx, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e; cur += e["size"]
        elif e["action"] == "free_requested" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
        else:
            continue
        if cur > best[0]:
            best = (cur, idx, dict(live))
    groups = defaultdict(lambda: [0, 0, set()])
    for e in best[2].values():
        g = groups[_frames(e, 4)]; g[0] += e["size"]; g[1] += 1; g[2].add(e["size"] // 2**20)
    at = trace[best[1]] if trace else {}
    return {"allocator_peak_gib": peak / 2**30, "allocated_before_gib": before / 2**30,
            "new_alive_at_peak_gib": best[0] / 2**30,
            "peak_event": {"size_mib": at.get("size", 0) / 2**20, "frames": _frames(at, 8) if at else "",
                           "index": best[1], "of": len(trace)},
            "alive_at_peak": sorted(([k, v[0] / 2**20, v[1], sorted(v[2])[:6]] for k, v in groups.items()),
                                    key=lambda r: -r[1])[:30]}
