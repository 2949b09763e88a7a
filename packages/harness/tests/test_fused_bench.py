"""cs336 fused: config validation and the writeup tables built from rows (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch
from cs336_harness.studies.fused import FusedBenchConfig, fused_markdown


def _rows() -> list[dict]:
    # Made-up rows with the fields the benchmark writes; only the table layout is under test.
    meta = {"device": "GPU-X", "commit": "abc"}
    adamw = [{"bench": "adamw", "impl": impl, "num_params": 10**9, "num_tensors": 16, "median_ms": ms,
              "floor_ms": 6.6, "floor_fraction": 6.6 / ms, "achieved_tbps": 28 / ms, "copy_tbps": 4.2,
              "speedup_vs_torch_fused": 8.0 / ms, **meta}
             for impl, ms in (("ours", 7.0), ("torch fused", 8.0))]
    ce = [{"bench": "linear_ce", "impl": "ours", "tokens": 32768, "d_model": 4096, "vocab_size": 151936,
           "dtype": "bf16", "median_ms": 190.0, "matmul_floor_ms": 158.0, "floor_fraction": 0.83,
           "extra_gib": 1.2, "speedup_vs_torch": 1.25, "loss_rel_err": 1e-4, **meta}]
    parts = {"bench": "linear_ce_parts", "impl": "ours", "chunk_rows": 4096, "num_chunks": 8,
             "logits_mm_ms": 50.0, "logits_mm_tflops": 700.0, "softmax_grad_kernel_ms": 8.0,
             "softmax_grad_kernel_tbps": 3.9, "grad_hidden_mm_ms": 55.0, "grad_hidden_mm_tflops": 650.0,
             "grad_weight_addmm_ms": 60.0, "grad_weight_addmm_tflops": 600.0, **meta}
    return adamw + ce + [parts]


def test_markdown_has_one_row_per_result_and_the_floors():
    text = fused_markdown(_rows())
    headers = ("| implementation", "| stage")
    table_rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(headers)]
    assert len(table_rows) == 3 + 4
    assert "| softmax grad kernel | 8 | 3.90 TB/s |" in text
    assert "bytes floor 6.60 ms" in text and "matmul floor 158 ms" in text
    assert "| ours | 7 | 1.14 |" in text
    assert fused_markdown([]) == ""
    older = [{**r, "date": "2026-01-01", "median_ms": 99.0} for r in _rows()]
    newer = [{**r, "date": "2026-01-02"} for r in _rows()]
    assert fused_markdown(older + newer) == fused_markdown(newer)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_config_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        FusedBenchConfig()


@pytest.mark.gpu
@pytest.mark.parametrize("change", [{"benches": ("lm",)}, {"adamw_tensors": 0}, {"tokens": 0}])
def test_config_rejects_bad_values(change):
    with pytest.raises(ValueError):
        FusedBenchConfig(**change)
