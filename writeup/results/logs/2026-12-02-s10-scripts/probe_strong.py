"""The strong baseline (FSDP2, compiled blocks, SDPA, chunked loss) on one H200 at the proxy shape and first:7: the
allocator's peak of steps 1-3 and what is alive at the peak of step 3 (memory history with python stacks, or with
none when argv[1] is 'none')."""
import json, os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, os.path.dirname(__file__))
from probe_common import peak_of
from cs336_harness.studies.leaderboard import PROXY_DEFAULTS, LeaderboardConfig
from cs336_harness.studies.leaderboard.config import RECIPES
from cs336_harness.studies.leaderboard.training import build_training, rank_batch

stacks = sys.argv[1]
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29563", rank=0, world_size=1, device_id=dev)
config = LeaderboardConfig(**{**PROXY_DEFAULTS, "backend": "nccl", "impl": "torch_native_compiled",
                              **RECIPES["torch_native_compiled"], "checkpoint": "first:7"})
tr = build_training(config, dev)
x, y = rank_batch(config, 0, dev)
peaks = []
for _ in range(2):
    torch.cuda.reset_peak_memory_stats()
    tr.step(x, y)
    torch.cuda.synchronize()
    peaks.append(torch.cuda.max_memory_allocated() / 2**30)
r = peak_of(lambda: tr.step(x, y), stacks=stacks)
r.update(stacks=stacks, steps_1_2_peak_gib=peaks, expected_peak_gib=tr.plan.expected_peak_bytes / 2**30,
         checkpoint=str(tr.plan.policy))
with open(f"{os.environ['OUT']}/probe_strong_{stacks}.json", "w") as f:
    json.dump(r, f)
print(json.dumps({k: v for k, v in r.items() if k != "alive_at_peak"}))
for a in r["alive_at_peak"][:25]:
    print("   ", round(a[1], 1), a[2], a[3], a[0][:220])
dist.destroy_process_group()
