"""cs336 tune: its flags, and the offline sm_90 builds of the attention kernels (no GPU): the TMA configs really load
by TMA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
from cs336_harness import cli
from cs336_harness.studies import attention_tuning

# The test session runs Triton's interpreter, which cannot compile; the builds run in a fresh process without it.
_BUILDS = """
import json
from cs336_harness.studies.attention_tuning import build_row
print(json.dumps([build_row(name, 64, entry, tma) for name, entry in (("fwd", (64, 64, 4, 3)), ("dkdv", (64, 64, 4, 3)))
                  for tma in (True, False)]))
"""


@pytest.mark.slow
def test_builds_with_and_without_tma_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _BUILDS], env=env, capture_output=True, text=True, check=True)
    fwd_tma, fwd, dkdv_tma, dkdv = json.loads(done.stdout.strip().splitlines()[-1])
    assert fwd_tma["config"] == [64, 64, 4, 3, "kv_tma"] and fwd["config"] == [64, 64, 4, 3]
    assert dkdv_tma["config"] == [64, 64, 4, 3, "qdo_tma"] and dkdv["config"] == [64, 64, 4, 3]
    for tma, plain in ((fwd_tma, fwd), (dkdv_tma, dkdv)):
        assert tma["tma_loads"] > 0 and plain["tma_loads"] == 0
        assert tma["wgmma"] > 0 and tma["wgmma"] == plain["wgmma"]
    # Main loops: two key loops in the forward, three query loops in the dK/dV kernel.
    assert len(fwd["loops"]) == len(fwd_tma["loops"]) == 2
    assert len(dkdv["loops"]) == len(dkdv_tma["loops"]) == 3


def test_entry_marks_tma_configs() -> None:
    config = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "KV_TMA": True}, num_warps=8, num_stages=3)
    assert attention_tuning._entry(config) == [128, 64, 8, 3, "kv_tma"]
    config = triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "QDO_TMA": True}, num_warps=8, num_stages=2)
    assert attention_tuning._entry(config) == [64, 128, 8, 2, "qdo_tma"]
    config = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)
    assert attention_tuning._entry(config) == [128, 64, 8, 3]


def test_command_takes_shapes_and_refuses_what_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    args = cli.parse_args(["tune", "--shapes", "1,32,32768,128", "2,16,8192,64", "--rep-ms", "5"])
    assert args.shapes == [(1, 32, 32768, 128), (2, 16, 8192, 64)] and args.rep_ms == 5 and not args.builds
    with pytest.raises(SystemExit):
        cli.parse_args(["tune", "--shapes", "1,32,0,128"])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit, match="TRITON_INTERPRET=0 cs336 tune --builds"):
        cli.main(["tune", "--builds"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            cli.main(["tune"])
