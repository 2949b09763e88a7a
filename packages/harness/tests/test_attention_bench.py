"""The attention benchmark's pure pieces: config validation, FLOP formula, markdown tables, CLI flags."""

from __future__ import annotations

import pytest
from cs336_harness.cli import parse_args
from cs336_harness.studies.attention import AttentionBenchConfig, attention_markdown, causal_attention_flops


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
