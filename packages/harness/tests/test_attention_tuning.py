"""Offline sm_90 builds of the attention kernels (no GPU): the forward's TMA configs really load by TMA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton
from cs336_harness import attention_tuning

# The test session runs Triton's interpreter, which cannot compile; the builds run in a fresh process without it.
_BUILDS = """
import json
from cs336_harness.attention_tuning import build_row
print(json.dumps([build_row("fwd", 64, (64, 64, 4, 3), kv_tma=True), build_row("fwd", 64, (64, 64, 4, 3))]))
"""


def test_forward_build_with_and_without_kv_tma() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _BUILDS], env=env, capture_output=True, text=True, check=True)
    tma, plain = json.loads(done.stdout.strip().splitlines()[-1])
    assert tma["config"] == [64, 64, 4, 3, "kv_tma"] and plain["config"] == [64, 64, 4, 3]
    assert tma["tma_loads"] > 0 and plain["tma_loads"] == 0
    assert tma["wgmma"] > 0 and tma["wgmma"] == plain["wgmma"]


def test_kv_tma_is_forward_only() -> None:
    with pytest.raises(ValueError, match="forward kernel only"):
        attention_tuning.build_row("dq", 64, (64, 64, 4, 3), kv_tma=True)


def test_entry_marks_tma_configs() -> None:
    config = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "KV_TMA": True}, num_warps=8, num_stages=3)
    assert attention_tuning._entry(config) == [128, 64, 8, 3, "kv_tma"]
    config = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)
    assert attention_tuning._entry(config) == [128, 64, 8, 3]
