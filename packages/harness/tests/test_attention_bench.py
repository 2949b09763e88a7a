"""The attention benchmark's pure pieces: config validation, FLOP formula, markdown tables, CLI flags, and the
FlashAttention-4 rows (its adapter, and the row that says why where it does not import)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from cs336_harness.cli import parse_args
from cs336_harness.studies.attention import (
    AttentionBenchConfig,
    anchor_impl,
    attention_markdown,
    causal_attention_flops,
    flash_rows,
)


def test_flops_follow_the_anchor_convention():
    flops = causal_attention_flops(1, 32, 32768, 128)
    assert flops["fwd"] == 4 * 32 * 32768**2 * 128 / 2
    assert flops["fwd_bwd"] == pytest.approx(3.5 * flops["fwd"])
    assert flops["bwd"] == pytest.approx(2.5 * flops["fwd"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"parts": ("nope",)}, "parts"),
        ({"parts": ()}, "parts"),
        ({"flash_dtypes": ("fp64",)}, "dtypes"),
        ({"seq_lens": (0, 256)}, "seq_lens"),
        ({"flash_head_dims": (8,)}, "head dims"),
        ({"passes": 0}, "passes"),
        ({"precompile_jobs": -1}, "precompile_jobs"),
        ({"anchor_impls": ("ours", "fa5")}, "anchor impls"),
        ({"anchor_impls": ()}, "anchor impls"),
        ({"anchor_shapes": ((1, 32, 4096),)}, "anchor shapes"),
        ({"anchor_shapes": ((1, 32, 0, 128),)}, "anchor shapes"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionBenchConfig(**kwargs)


def test_markdown_pivots_rows_and_marks_oom():
    device = {"device": "test-gpu"}
    rows = [
        {"bench": "pytorch", "batch": 8, "seq": 256, "d": 16, "passes": 3, "status": "ok", "fwd_ms": 0.5,
         "bwd_ms": 1.25, "mem_before_bwd_gib": 0.1, "saved_for_bwd_gib": 0.05, **device},
        {"bench": "pytorch", "batch": 8, "seq": 65536, "d": 16, "passes": 3, "status": "oom", **device},
        {"bench": "compiled", "batch": 8, "seq": 256, "d": 16, "passes": 3, "status": "ok", "fwd_ms": 0.25,
         "bwd_ms": 0.75, **device},
        {"bench": "flash", "impl": "triton", "dtype": "bf16", "seq": 128, "d": 64, "status": "ok", "fwd_ms": 0.01,
         "bwd_ms": 0.02, "fwd_bwd_ms": 0.03, "fwd_bwd_tflops": 1.5, **device},
        {"bench": "flash", "impl": "pytorch", "dtype": "bf16", "seq": 128, "d": 64, "status": "oom",
         "fwd_ms": 0.04, "bwd_ms": None, "fwd_bwd_ms": None, **device},
    ]
    text = attention_markdown(rows)
    assert "| 16 | 256 | 0.5 | 1.25 | 0.1 | 0.05 |\n" in text
    assert "| 16 | 65536 | OOM | OOM | OOM | OOM |\n" in text
    assert "eager (mean of 3 passes) vs torch.compile(dynamic=True) (mean of 3 passes)" in text
    assert "| 16 | 256 | 0.5 | 0.25 | 2 | 1.25 | 0.75 | 1.67 | 0.05 | - |" in text
    assert "| 64 | 128 | 0.01 | 0.02 | 0.03 | 0.04 | OOM | OOM | - | - | - | 1.5 | - |" in text


def test_anchor_table_keeps_the_latest_row_of_each_timed_impl():
    def row(impl, date, fwd_bwd_ms):
        return {"bench": "anchors", "impl": impl, "batch": 1, "heads": 16, "seq": 16384, "d": 64, "date": date,
                "device": "test-gpu", "fwd_ms": 1.0, "bwd_ms": 2.0, "fwd_bwd_ms": fwd_bwd_ms,
                "fwd_tflops": 1.0, "bwd_tflops": 1.0, "fwd_bwd_tflops": 1.0, "target_fwd_bwd_ms": 4.0}

    rows = [row("sdpa", "2026-01-02", 4.5), row("triton", "2026-01-02", 5.5), row("triton", "2026-01-01", 9.9),
            row("triton_atomic", "2026-01-01", 6.0)]
    text = attention_markdown(rows)
    lines = [line for line in text.splitlines() if line.startswith("| (1, 16, 16384, 64)")]
    # Ours first, then SDPA; the older triton row and the removed atomic variant are left out.
    assert [line.split(" | ")[1:5] for line in lines] == [["triton", "1", "2", "5.5"], ["sdpa", "1", "2", "4.5"]]


def test_cli_quick_flag_parses():
    args = parse_args(["attention", "--quick", "--part", "flash", "--flash-dtypes", "bf16"])
    assert args.quick and args.part == ["flash"] and args.flash_dtypes == ("bf16",)


def test_anchor_table_skips_rows_without_times():
    def row(impl, date, status="ok"):
        timed = {"fwd_ms": 1.0, "bwd_ms": 2.0, "fwd_bwd_ms": 3.0, "fwd_tflops": 1.0, "bwd_tflops": 1.0,
                 "fwd_bwd_tflops": 1.0} if status == "ok" else {"note": "flash_attn.cute is not importable"}
        return {"bench": "anchors", "impl": impl, "batch": 1, "heads": 32, "seq": 16384, "d": 128, "date": date,
                "device": "test-gpu", "status": status, **timed}

    rows = [row("fa4", "2026-01-01"), row("fa4", "2026-01-02", "skipped"), row("fa4_deterministic", "2026-01-02",
                                                                            "skipped"), row("sdpa", "2026-01-02")]
    lines = [line for line in attention_markdown(rows).splitlines() if line.startswith("| (1, 32, 16384, 128)")]
    # The later skipped FA4 row leaves the timed one in place; FA4 comes after the PyTorch baselines.
    assert [line.split(" | ")[1:5] for line in lines] == [["sdpa", "1", "2", "3"], ["fa4", "1", "2", "3"]]


def test_fa4_rows_say_why_where_it_does_not_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # any import of it fails, as on a machine without FA4
    rows = list(flash_rows((2, 3, 128, 64), "bf16", ("fa4", "fa4_deterministic"), 10, AttentionBenchConfig(),
                           "anchors"))
    assert [(r["impl"], r["status"]) for r in rows] == [("fa4", "skipped"), ("fa4_deterministic", "skipped")]
    assert all(r["note"].startswith("flash_attn.cute is not importable: ") for r in rows)
    assert all("fwd_ms" not in r for r in rows)


def test_fa4_adapter_passes_batch_seq_heads_d_and_the_deterministic_flag(monkeypatch):
    calls = []

    def flash_attn_func(q, k, v, causal, deterministic):
        # FA4's convention: (batch, seq, heads, d) in, (out, lse) back.
        calls.append((q.shape, causal, deterministic))
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)
        return out.transpose(1, 2), None

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    q, k, v = torch.randn(3, 2, 5, 37, 16, dtype=torch.float64).unbind(0)  # (batch, heads, seq, d)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for name, deterministic in (("fa4", False), ("fa4_deterministic", True)):
        out = anchor_impl(name, 37, torch.device("cpu"))(q, k, v)
        assert out.shape == q.shape
        torch.testing.assert_close(out, expected)
        assert calls.pop() == ((2, 37, 5, 16), True, deterministic)


def test_cli_anchor_selection_parses():
    args = parse_args(["attention", "--part", "anchors", "--anchor-impls", "ours,fa4", "--anchor-shapes",
                       "1,32,16384,128", "4,32,4096,128"])
    assert args.anchor_impls == ("ours", "fa4")
    assert args.anchor_shapes == [(1, 32, 16384, 128), (4, 32, 4096, 128)]
    with pytest.raises(SystemExit):
        parse_args(["attention", "--anchor-shapes", "1,32,16384"])
