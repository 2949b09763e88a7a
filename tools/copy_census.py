"""The copies and casts of one proxy training step of ours, counted on fake tensors (no GPU): one row of ``kind:
census`` per call site, bytes read plus written, largest first.

It runs the step as ``traced_peak`` does (the second step, after AdamW's state exists) under a dispatch mode that
records every ``_to_copy``, ``copy_``, ``clone`` and ``cat``: source and result dtypes, and where in our packages it was
called (the two innermost frames). What the GPU profile's "copies and casts" time is made of, and which of it a
different layout or schedule could remove.

    uv run python tools/copy_census.py                     # the proxy's budget policy at 92 GiB
    uv run python tools/copy_census.py --checkpoint none   # appends its rows to writeup/results/copy_census.jsonl
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections import Counter
from pathlib import Path

import torch
from cs336_harness.analysis.live_memory import LiveMemory, fake_tensors
from cs336_harness.memory_plan import memory_plan
from cs336_harness.results import append_rows
from cs336_harness.studies.leaderboard import PROXY_DEFAULTS, LeaderboardConfig
from cs336_harness.train_config import TrainConfig
from cs336_harness.training import build_training, rank_batch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

RESULTS = Path(__file__).resolve().parents[1] / "writeup" / "results"
_COPIES = ("aten::_to_copy", "aten::copy_", "aten::clone", "aten::cat")


class _Census(TorchDispatchMode):
    """Bytes moved and calls of the copy operators, by (operator, source dtype, result dtype, call site)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.name() in _COPIES:
            inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            sources = inputs[1:] if func.name() == "aten::copy_" else inputs
            frames = [f for f in traceback.extract_stack()[:-1] if "/cs336_" in f.filename]
            site = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-2:]))
            key = (func.name(), str(sources[0].dtype).removeprefix("torch."),
                   str(outputs[0].dtype).removeprefix("torch."), site or "(autograd engine)")
            moved = sum(t.numel() * t.element_size() for t in [*sources, *outputs])
            self.bytes[key] += moved
            self.calls[key] += 1
        return out


def census(config: TrainConfig) -> list[dict]:
    cpu = torch.device("cpu")
    with fake_tensors(), LiveMemory():
        training = build_training(config, cpu)
        inputs, targets = rank_batch(config, 0, cpu)
        training.step(inputs, targets)
        with _Census() as counted:
            training.step(inputs, targets)
    policy = str(memory_plan(config, None).policy)
    return [{"kind": "census", "what": "bytes read and written by one copy operator at one call site in one step, "
             "on fake tensors", "checkpoint": policy, "op": op, "from_dtype": src, "to_dtype": dst, "site": site,
             "calls": counted.calls[key], "gb": moved / 1e9}
            for key, moved in counted.bytes.most_common() for op, src, dst, site in [key]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="budget", help="the proxy's policy (default: budget at 92 GiB)")
    args = parser.parse_args()
    config = LeaderboardConfig(**{**PROXY_DEFAULTS, "backend": "nccl", "glue": "triton", "checkpoint": args.checkpoint,
                                  "memory_cap_gib": 92.0 if args.checkpoint == "budget" else None})
    rows = census(config.train_config())
    append_rows(RESULTS / "copy_census.jsonl", rows)
    print(f"{sum(r['gb'] for r in rows):.1f} GB moved by copies in one step ({rows[0]['checkpoint']})")
    for r in rows:
        print(json.dumps({k: r[k] for k in ("op", "from_dtype", "to_dtype", "site", "calls", "gb")}))


if __name__ == "__main__":
    main()
