"""cs336 fused: config validation, the writeup tables built from rows, the glue cases' wiring, and the kernels'
references against the model's own modules (the timing itself needs a GPU).

On CPU the glue cases run at small sizes through the Triton interpreter, whose bf16 rounding differs from
PyTorch's, so they only check wiring (shapes, layouts, gradients reaching the leaves); on the GPU they run at the
leaderboard shapes against the model's modules in bf16.
"""

from __future__ import annotations

import pytest
import torch
from cs336_basics.model import RMSNorm, RotaryEmbedding, SwiGLU
from cs336_harness.studies.fused import FusedBenchConfig, block_glue, fused_markdown
from cs336_kernels import add_rms_norm_reference, rms_norm_reference, rope_reference, silu_mul_reference

# ||ours - eager module|| / ||eager module||: bf16 outputs differ only by rare one-ulp flips on the GPU; the
# gradients by one rounding of differently ordered fp32 sums (RMSNorm, RoPE) or by rounding once where the module
# rounds five times (SwiGLU's da). The interpreter truncates bf16, which costs an ulp on about half the elements.
GPU_OUT_TOL = 5e-4
GPU_GRAD_TOL = 1e-2
INTERPRETER_TOL = 2e-2


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
    glue = [{"bench": "glue", "op": "rms_norm", "shape": "32768x4096", "dtype": "bf16", "bytes_moved": 1342177280,
             "impl": impl, "median_ms": ms, "gbps": 1342.18 / ms, "extra_gib": 0.5, "speedup_vs_eager": 5.7 / ms,
             "out_rel_err_vs_eager": err, **meta}
            for impl, ms, err in (("ours", 0.4, 1e-5), ("eager", 5.7, 0.0))]
    glue.append({"bench": "glue", "op": "rms_norm", "shape": "32768x4096", "dtype": "bf16", "impl": "liger",
                 "bytes_moved": 1342177280, "note": "liger_kernel is not importable", **meta})
    return adamw + ce + [parts] + glue


def test_markdown_has_one_row_per_result_and_the_floors():
    text = fused_markdown(_rows())
    headers = ("| implementation", "| stage")
    table_rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(headers)]
    assert len(table_rows) == 3 + 4 + 3
    assert "| softmax grad kernel | 8 | 3.90 TB/s |" in text
    assert "rms_norm forward + backward, 32768x4096 bf16" in text and "1.34 GB must move" in text
    assert "| ours | 0.4 | 3.36e+03 | 14.2 | 0.5 | 1e-05 | - |" in text
    assert "| liger | - | - | - | - | - | liger_kernel is not importable |" in text
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


def _tiny_cases(device: str) -> dict[str, block_glue.GlueCase]:
    return {"rms_norm": block_glue.rms_norm_case(37, 24, None, device),
            "add_rms_norm": block_glue.add_rms_norm_case(37, 24, None, device),
            "rope": block_glue.rope_case(11, 24, 3, None, device),
            "silu_mul": block_glue.swiglu_case(9, 40, None, device)}


def _outputs_and_grads(impl: block_glue.GlueImpl) -> list[torch.Tensor]:
    outs = impl.run()
    torch.autograd.backward(outs, impl.upstream)
    grads = [leaf.grad for leaf in impl.leaves]
    for leaf in impl.leaves:
        leaf.grad = None
    return [out.detach() for out in outs] + grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_glue_cases_wiring_on_cpu(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn: fn)  # the compiled rows run the same reference, uncompiled
    cases = _tiny_cases("cpu")
    for op, (_, _, impls) in cases.items():
        assert impls["liger"] == "skipped" and set(impls) == {"ours", "torch_compile", "eager", "liger"}, op
        results = {name: _outputs_and_grads(impl) for name, impl in impls.items() if name != "liger"}
        for name, result in results.items():
            for got, want in zip(result, results["eager"], strict=True):
                assert got.shape == want.shape and got.dtype == want.dtype, (op, name)
                assert _rel(got, want) < INTERPRETER_TOL, (op, name, _rel(got, want))
    # bytes that must move: 5 passes over x of 37 x 24 bf16, rstd twice, w read twice and dw written
    assert cases["rms_norm"][:2] == ("37x24", 5 * 37 * 24 * 2 + 8 * 37 + 3 * 24 * 2)
    # the add folded in: x, delta, h, y forward; dy, dh, h, dx backward
    assert cases["add_rms_norm"][:2] == ("37x24", 8 * 37 * 24 * 2 + 8 * 37 + 3 * 24 * 2)
    assert cases["rope"][:2] == ("1x11x3x8", 4 * 2 * 11 * 24 * 2 + 8 * 11 * 8 + 16 * 11)
    assert cases["silu_mul"][:2] == ("9x40", 8 * 9 * 40 * 2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_are_the_model_modules(device, dtype):
    """The kernels' PyTorch references (their tests' oracles, the benchmark's compiled rows) compute exactly what
    the model's modules compute."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2, 7, 32, generator=gen, device=device).to(dtype)
    norm = RMSNorm(32, device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(32, generator=gen, device=device))
    assert torch.equal(rms_norm_reference(x, norm.weight), norm(x))
    delta = torch.randn(2, 7, 32, generator=gen, device=device).to(dtype)
    h, y = add_rms_norm_reference(x, delta, norm.weight)
    assert torch.equal(h, x + delta) and torch.equal(y, norm(x + delta))  # TransformerBlock's add, then its ln2

    rotary = RotaryEmbedding(16, 8, device=device)
    q, k = (torch.randn(2, 7, 4, 8, generator=gen, device=device).to(dtype) for _ in range(2))  # (b, s, h, d)
    positions = torch.randint(0, 16, (2, 7), generator=gen, device=device)
    q_rot, k_rot = rope_reference(q, k, rotary.cos, rotary.sin, positions)
    for ours, t in ((q_rot, q), (k_rot, k)):  # the module works on (b, h, s, d) with (b, 1, s) positions
        assert torch.equal(ours, rotary(t.transpose(1, 2), positions[:, None]).transpose(1, 2))

    ffn = SwiGLU(32, 48, device=device, dtype=dtype)
    assert torch.equal(ffn.w2(silu_mul_reference(ffn.w1(x), ffn.w3(x))), ffn(x))


@pytest.mark.gpu
def test_glue_kernels_match_the_model_modules_on_gpu():
    tokens, d_model, heads, d_ff = 32768, 4096, 32, 11008
    cases = {"rms_norm": block_glue.rms_norm_case(tokens, d_model, None),
             "add_rms_norm": block_glue.add_rms_norm_case(tokens, d_model, None),
             "rope": block_glue.rope_case(tokens, d_model, heads, None),
             "silu_mul": block_glue.swiglu_case(tokens, d_ff, None)}
    for op, (_, _, impls) in cases.items():
        ours, eager = _outputs_and_grads(impls["ours"]), _outputs_and_grads(impls["eager"])
        num_outputs = len(impls["ours"].upstream)
        for i, (got, want) in enumerate(zip(ours, eager, strict=True)):
            assert torch.isfinite(got).all(), (op, i)
            tol = GPU_OUT_TOL if i < num_outputs else GPU_GRAD_TOL
            assert _rel(got, want) < tol, (op, i, _rel(got, want))
