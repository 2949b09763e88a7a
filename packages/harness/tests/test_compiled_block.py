"""``cs336 block``'s study on CPU (the kernels in Triton's interpreter, fp32, a tiny block): the variants build the
same block, ours compiles without a graph break, bad configs are refused; the timing itself needs a GPU."""

from __future__ import annotations

import pytest
import torch
from cs336_harness.studies.compiled_block import BlockBenchConfig, graph_breaks, run_block_bench, variant_block

TINY = BlockBenchConfig(size="tiny", seq=24, dtype="fp32")


def _x() -> torch.Tensor:
    d_model = TINY.model_config.d_model
    return torch.randn(1, TINY.seq, d_model, generator=torch.Generator().manual_seed(0))


def test_our_kernels_compute_the_models_block():
    x = _x()
    ours, torch_block = variant_block(TINY, "eager_ours", "cpu"), variant_block(TINY, "eager_torch", "cpu")
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), torch_block.state_dict().values(),
                                                 strict=True))
    expected = torch_block(x)
    assert ((ours(x) - expected).norm() / expected.norm()).item() < 1e-5


@pytest.mark.slow
def test_our_block_compiles_without_a_graph_break():
    assert graph_breaks(variant_block(TINY, "compiled_ours", "cpu"), _x()) == 0


@pytest.mark.parametrize(("field", "value", "match"), [
    ("size", "huge", "size must be one of"), ("dtype", "int8", "dtype must be one of"),
    ("variants", ("eager_ours", "fast"), "variants must be among"), ("variants", (), "variants must be among"),
    ("seq", 0, "seq must be a positive int"), ("batch", True, "batch must be a positive int"),
])
def test_bad_configs_are_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        BlockBenchConfig(**{field: value})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_timing_without_a_gpu_says_it_needs_one():
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        run_block_bench(TINY)


@pytest.mark.gpu
def test_gpu_rows_of_every_variant():
    rows = run_block_bench(BlockBenchConfig(size="small", seq=1024, warmup_ms=5, rep_ms=20))
    assert [r["variant"] for r in rows] == list(BlockBenchConfig.variants)
    assert all(r["fwd_bwd_ms"] > r["fwd_ms"] > 0 for r in rows)
    assert [r["graph_breaks"] for r in rows if r["compiled"]] == [0, 0]
    assert next(r for r in rows if r["variant"] == "compiled_torch")["vs_compiled_torch"] == 1.0
