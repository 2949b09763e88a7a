"""Ours at test_gpu_allocator_peak_is_the_traced_peak's config, no process group (as the test): the allocator's peak
of steps 1, 2 and 3 and what is alive at each peak of steps 2 and 3, against the fake-tensor count."""
import json, os, sys
import torch
sys.path.insert(0, os.path.dirname(__file__))
from probe_common import peak_of
from cs336_harness.studies.leaderboard import PROXY_DEFAULTS, LeaderboardConfig, traced_peak
from cs336_harness.studies.leaderboard.training import build_training, rank_batch

config = LeaderboardConfig(**{**PROXY_DEFAULTS, "backend": "nccl", "glue": "triton", "num_layers": 3,
                              "checkpoint": "attention:1", "context_length": 8192})
dev = torch.device("cuda")
torch.cuda.empty_cache()
tr = build_training(config, dev)
x, y = rank_batch(config, 0, dev)
torch.cuda.reset_peak_memory_stats()
tr.step(x, y)
torch.cuda.synchronize()
rows = [{"step": 1, "allocator_peak_gib": torch.cuda.max_memory_allocated() / 2**30}]
for step in (2, 3):
    r = peak_of(lambda: tr.step(x, y)); r["step"] = step; rows.append(r)
traced = traced_peak(config).peak_bytes / 2**30
with open(f"{os.environ['OUT']}/probe_ours_steps.jsonl", "w") as f:
    for r in rows:
        r["traced_gib"] = traced
        f.write(json.dumps(r) + "\n")
        print(json.dumps({k: v for k, v in r.items() if k != "alive_at_peak"}))
        for a in r.get("alive_at_peak", [])[:12]:
            print("   ", round(a[1], 1), a[2], a[3], a[0][:200])
