"""The one-GPU proxy of a leaderboard rank and what it is built from: the proxy config and its memory cap, the
per-block activation estimate against what autograd really keeps, the budget policy, the glue kernels wired into
the model (outputs and gradients equal to the model's own code), the baselines' chunked loss head, the kernel-time
breakdown of a trace, the proxy tables, and the command on CPU.

The glue comparisons run the Triton kernels in the interpreter, in fp32, against the model's PyTorch code in
fp32: they differ by fp32 rounding (operation order inside the kernels), hence the fp32 tolerances below."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cs336_basics.config import ModelConfig
from cs336_basics.model import BasicsTransformerLM, BlockKernels, RotaryEmbedding, TransformerBlock, TransformerBlocks
from cs336_harness import cli, registry
from cs336_harness.analysis import kernel_kinds
from cs336_harness.commands import leaderboard as leaderboard_command
from cs336_harness.device import GIB
from cs336_harness.memory_plan import default_memory_cap_bytes, expected_peak_bytes, memory_plan, reserved_bytes
from cs336_harness.step_memory import compiled_block_memory, measure_block
from cs336_harness.studies import leaderboard
from cs336_harness.studies.leaderboard import LeaderboardConfig
from cs336_harness.train_config import Parallelism, TrainConfig, build_model, saved_ops
from cs336_sharding.checkpointing import activation_peak_bytes, apply_checkpointing
from cs336_sharding.parallelize import apply_compile

# fp32 rounding of differently ordered sums inside a kernel against the model's ops, over two blocks.
OUT_ATOL, OUT_RTOL = 1e-5, 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-5, 1e-4


# The proxy and its memory cap.

def _state(config: ModelConfig, world_size: int) -> float:
    return 16 * config.num_params / world_size


def test_proxy_holds_a_ranks_state_on_one_gpu() -> None:
    proxy = LeaderboardConfig(**{**leaderboard.PROXY_DEFAULTS, "compute_dtype": "fp32"}, backend="gloo")
    full = LeaderboardConfig(**{**leaderboard.LEADERBOARD_DEFAULTS, "compute_dtype": "fp32"}, backend="gloo")
    assert (proxy.world_size, proxy.global_batch, proxy.batch_per_rank) == (1, 1, 1)
    assert (proxy.model_config.num_layers, proxy.model_config.d_model, proxy.model_config.d_ff) == (14, 4096, 11008)
    rank_state = _state(full.model_config, 2)
    # 14 layers are the nearest: 13 or 15 would be further from one rank's fp32 state.
    for layers in (13, 15):
        other = ModelConfig.from_preset("8B", vocab_size=151_936, num_layers=layers)
        assert abs(_state(other, 1) - rank_state) > abs(_state(proxy.model_config, 1) - rank_state)
    device = 150 * GIB
    usable = device - 4 * GIB  # the CUDA context, NCCL's buffers, fragmentation
    full, proxy = full.train_config(), proxy.train_config()
    assert default_memory_cap_bytes(full, device) == pytest.approx(usable)  # the real rank: all of it
    want = _state(proxy.model, 1) + (usable - rank_state) * 14 / 34
    assert default_memory_cap_bytes(proxy, device) == pytest.approx(want)
    h200 = 143_771 * 2**20  # torch.cuda.get_device_properties(0).total_memory on the lent H200
    assert default_memory_cap_bytes(proxy, h200) == pytest.approx(92 * GIB, abs=0.01 * GIB)


def _parse(*flags: str) -> argparse.Namespace:
    return cli.parse_args(["leaderboard", *flags])


def test_proxy_flag_gives_our_step_and_both_baselines() -> None:
    args = _parse("--proxy", "--compute-dtype", "fp32", "--backend", "gloo", "--glue", "triton", "--memory-cap-gib",
                  "92", "--impl", "ours,torch_native,torch_native_compiled", "--checkpoint", "budget")
    ours, plain, strong = leaderboard_command.configs_from_args(args)
    for c in (ours, plain, strong):
        assert (c.size, c.num_layers, c.world_size, c.global_batch, c.memory_cap_gib) == ("8B", 14, 1, 1, 92.0)
    assert (ours.impl, ours.attention, ours.glue, ours.optimizer, ours.checkpoint) == (
        "ours", "triton", "triton", "fused-adamw", "budget")
    for c, impl, compiled, checkpoint in ((plain, "torch_native", False, "all"),
                                          (strong, "torch_native_compiled", True, "budget")):
        assert (c.impl, c.attention, c.glue, c.optimizer, c.compile_blocks, c.checkpoint) == (
            impl, "sdpa", "model", "torch-adamw", compiled, checkpoint)  # the recipes', whatever ours uses


@pytest.mark.parametrize(("changes", "message"), [
    (dict(impl="torch_native", attention="triton"), "impl 'torch_native' is PyTorch's step"),
    (dict(impl="torch_native_compiled", attention="sdpa", optimizer="torch-adamw"), "compile_blocks"),
    (dict(impl="mine"), "impl must be one of"),
    (dict(glue="cuda"), "glue must be one of"),
    (dict(checkpoint="budget"), "budget' on CPU needs memory_cap_gib"),
    (dict(memory_cap_gib=0.0), "memory_cap_gib must be positive"),
    (dict(num_layers=0), "num_layers must be a positive int"),
])
def test_config_rejects_bad_proxy_settings(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LeaderboardConfig(**{**leaderboard.CPU_DEFAULTS, "backend": "gloo", **changes})
    with pytest.raises(TypeError, match="profile must be a bool"):
        LeaderboardConfig(**{**leaderboard.CPU_DEFAULTS, "backend": "gloo", "profile": 1})


# What one block keeps: the count on fake tensors against what autograd keeps running it.

def _kept_bytes(block: torch.nn.Module, x: torch.Tensor) -> int:
    """The block's output plus every storage autograd saves in its forward, except parameters, buffers and x."""
    skip = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers(), x]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    return sum(saved.values()) + out.untyped_storage().nbytes()


_SHAPE = ModelConfig(d_model=64, d_ff=96, num_layers=1, num_heads=4, context_length=32)


def _block(dtype: torch.dtype, glue: str, fused_qkv: bool, attention: str | None = None,
           **overrides) -> TransformerBlock:
    """A seeded block with ``glue``'s kernels (``overrides`` replacing some) and, by default, the Triton attention
    with the kernels and SDPA with the model's glue."""
    torch.manual_seed(0)
    attention = attention or ("triton" if glue != "model" else "sdpa")
    kernels = BlockKernels(attention=registry.attention(attention), **{**registry.glue(glue), **overrides})
    block = TransformerBlock(64, 4, 96, RotaryEmbedding(32, 16), kernels=kernels, fused_qkv=fused_qkv).to(dtype)
    encoder = block.attn.positional_encoder
    encoder.cos, encoder.sin = encoder.cos.float(), encoder.sin.float()  # FSDP keeps the tables fp32
    return block


@pytest.mark.parametrize(("dtype", "glue", "fused_qkv", "attention"), [
    (torch.bfloat16, "model", False, "sdpa"), (torch.float32, "model", False, "sdpa"),
    (torch.bfloat16, "model", True, "sdpa"),
    # Our attention after the model's RoPE: its output is heads-first, so the output projection keeps a copy.
    pytest.param(torch.float32, "model", False, "triton", marks=pytest.mark.slow),
    pytest.param(torch.float32, "triton", False, "triton", marks=pytest.mark.slow),
    (torch.bfloat16, "triton", True, "triton"),
])
def test_block_memory_is_what_autograd_keeps(dtype: torch.dtype, glue: str, fused_qkv: bool, attention: str) -> None:
    batch, seq = 2, 23
    # Bytes only: on CPU the interpreter refuses bf16 attention, so the block runs in fp16 there, the same size.
    run_dtype = torch.float16 if (dtype, attention, torch.cuda.is_available()) == (torch.bfloat16, "triton", False) \
        else dtype
    x = torch.randn(batch, seq, 64, dtype=run_dtype, requires_grad=True)
    want = _kept_bytes(_block(run_dtype, glue, fused_qkv, attention), x)
    config = TrainConfig(dataclasses.replace(_SHAPE, context_length=seq), kernels=registry.kernels(attention, glue),
                         parallelism=Parallelism(compute_dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]),
                         global_batch=batch, fused_qkv=fused_qkv)
    got = measure_block(config).memory
    assert got.kept == want
    # The segments keep the block's output; with the fused attention's outputs (its output and log-sum-exp); and
    # the outputs of the matmuls but the down projection (q, k, v, the output projection's, w1's and w3's).
    e, n = dtype.itemsize, batch * seq
    assert got.checkpointed == e * n * 64 and got.attention == 2 * e * n * 64 + 4 * n * 4
    assert got.selective == got.attention + 4 * e * n * 64 + 2 * e * n * 96


@pytest.mark.slow
def test_compiled_glue_keeps_no_more_than_the_estimate() -> None:
    x = torch.randn(2, 23, 64, dtype=torch.bfloat16, requires_grad=True)
    block = _block(torch.bfloat16, "compiled", False, attention="sdpa")
    estimate = compiled_block_memory(_SHAPE, 2, 23, dtype_bytes=2, fused_qkv=False, attention_copied=True)
    assert _kept_bytes(block, x) <= estimate.kept


@pytest.mark.slow
def test_compiled_selective_block_keeps_the_estimate() -> None:
    # Inductor on CPU, the block compiled with its checkpoint (the strong baseline's selective blocks): its output
    # and the outputs the op policy saves, exactly.
    x = torch.randn(2, 23, 64, requires_grad=True)
    holder = torch.nn.Module()
    holder.layers = TransformerBlocks([_block(torch.float32, "model", False, attention="sdpa")])
    apply_compile(apply_checkpointing(holder, "selective", saved_ops(_SHAPE)))
    estimate = compiled_block_memory(_SHAPE, 2, 23, dtype_bytes=4, fused_qkv=False, attention_copied=False)
    assert _kept_bytes(holder.layers[0], x) == estimate.selective


# The memory plan.

def test_memory_plan_reports_the_policy_and_the_expected_peak() -> None:
    leaderboard_config = LeaderboardConfig(**{**leaderboard.CPU_DEFAULTS, "backend": "gloo", "checkpoint": "budget",
                                              "memory_cap_gib": 1.0})
    config = leaderboard_config.train_config()
    plan = memory_plan(config, None)
    assert str(plan.policy) == "none" and plan.cap_bytes == GIB  # a tiny model fits in 1 GiB
    assert plan.expected_peak_bytes == expected_peak_bytes(config, plan.step, plan.policy)
    blocks = activation_peak_bytes(plan.step.block, 2, "none")
    assert plan.expected_peak_bytes >= reserved_bytes(config, plan.step) + blocks
    grouped = dataclasses.replace(leaderboard_config, checkpoint="group:2", memory_cap_gib=None).train_config()
    plain = memory_plan(grouped, None)  # segments of several blocks are planned too
    assert plain.cap_bytes is None and plain.expected_peak_bytes == expected_peak_bytes(grouped, plain.step,
                                                                                         plain.policy)
    with pytest.raises(ValueError, match="checkpoint 'budget' needs memory_cap_gib without a GPU"):
        memory_plan(dataclasses.replace(config, parallelism=Parallelism(checkpoint="budget")), None)


def test_strong_baselines_budget_mixes_full_and_selective_blocks_on_the_proxy() -> None:
    # 92 GiB, the proxy's cap on an H200: with selective blocks four recompute their matmuls, where full
    # checkpointing alone (first:N) needs seven.
    proxy = LeaderboardConfig(**leaderboard.PROXY_DEFAULTS, backend="nccl", memory_cap_gib=92.0)
    config = leaderboard.recipe(proxy, "torch_native_compiled").train_config()
    plan = memory_plan(config, None)
    assert str(plan.policy) == "first:4+selective:8" and plan.expected_peak_bytes <= plan.cap_bytes
    budget, block = plan.cap_bytes - reserved_bytes(config, plan.step), plan.step.block
    assert activation_peak_bytes(block, 14, "first:3+selective:10") > budget
    assert activation_peak_bytes(block, 14, "first:4+selective:7") > budget
    assert activation_peak_bytes(block, 14, "first:6") > budget >= activation_peak_bytes(block, 14, "first:7")


# The glue wired into the model.

def _lm(attention: str = "sdpa", glue: str = "model", fused_qkv: bool = False) -> BasicsTransformerLM:
    # Head dim 16: the Triton attention's smallest.
    model = ModelConfig(vocab_size=37, context_length=13, d_model=32, num_layers=2, num_heads=2, d_ff=40)
    return build_model(model, registry.kernels(attention, glue), fused_qkv=fused_qkv)


def _loss_and_grads(model: BasicsTransformerLM) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 37, (2, 7), generator=gen), torch.randint(0, 37, (2, 7), generator=gen)
    loss = model(tokens, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(("attention", "fused_qkv", "checkpoint"), [
    ("sdpa", False, "none"), pytest.param("triton", True, "attention:1", marks=pytest.mark.slow),
])
def test_triton_glue_matches_the_models_code(attention: str, fused_qkv: bool, checkpoint: str) -> None:
    plain = _lm(attention)
    kernels = registry.glue("triton")
    glued = _lm(attention, "triton", fused_qkv)
    glued = apply_checkpointing(glued, checkpoint, saved_ops(glued.config))
    assert [n for n, _ in glued.named_parameters()] == [n for n, _ in plain.named_parameters()]
    block = glued.layers[0]
    assert (block.ln1.norm, block.ln2.norm, glued.ln_final.norm) == (kernels["norm"],) * 3
    assert (block.add_norm, block.attn.rotary, block.ffn.gate) == (kernels["add_norm"], kernels["rotary"],
                                                                    kernels["gate"])
    loss, grads = _loss_and_grads(glued)
    want_loss, want_grads = _loss_and_grads(plain)
    torch.testing.assert_close(loss, want_loss, atol=OUT_ATOL, rtol=OUT_RTOL)
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=lambda m, n=name: f"{n}: {m}")


def _block_outputs_and_grads(block: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out = block(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype))
    return [out.detach(), x.grad, *(p.grad for p in block.parameters())]


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_folded_residual_add_is_the_unfused_block_bit_for_bit(dtype: torch.dtype) -> None:
    # The fold rounds where PyTorch's add, the norm kernel and autograd's sum of h's two gradients round, so the
    # block is the same computation with or without it: equal, not close. (bf16 is left to the GPU: the interpreter
    # truncates to bf16 where PyTorch rounds to nearest.)
    folded = _block(dtype, "triton", False)
    unfused = _block(dtype, "triton", False, add_norm=None)  # the same weights (seeded), ln2 the norm kernel
    assert folded.add_norm is not None and unfused.ln2.norm is not None
    assert [n for n, _ in folded.named_parameters()] == [n for n, _ in unfused.named_parameters()]
    x = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    got, want = _block_outputs_and_grads(folded, x), _block_outputs_and_grads(unfused, x)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), i


class _CountedLaunches:
    """Stands in for a Triton kernel: runs it and counts the launches with the residual add folded in (ADD)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.adds = kernel, 0

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.adds += bool(kwargs["ADD"])
            return launch(*args, **kwargs)

        return run


@pytest.mark.parametrize(("checkpoint", "recomputed"), [
    # The quick run keeps selective: its counts show both the forward's launch per block and the recomputation, and
    # without checkpointing the step is test_triton_glue_matches_the_models_code's.
    pytest.param("none", 0, marks=pytest.mark.slow), pytest.param("attention", 2, marks=pytest.mark.slow),
    ("selective", 2)])
def test_checkpointing_recomputes_the_folded_add(checkpoint: str, recomputed: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Neither policy saves an RMSNorm op's output, so the fold (the operator cs336::add_rms_norm_forward) is
    # recomputed with the rest of each checkpointed block, as ln2 was: one launch per block.
    from cs336_kernels.ops import rms_norm as rms_norm_module

    forward = _CountedLaunches(rms_norm_module._rms_norm_fwd_kernel)
    monkeypatch.setattr(rms_norm_module, "_rms_norm_fwd_kernel", forward)
    plain = _lm()
    glued = _lm(glue="triton")
    glued = apply_checkpointing(glued, checkpoint, saved_ops(glued.config))
    gen = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 37, (2, 7), generator=gen), torch.randint(0, 37, (2, 7), generator=gen)
    loss = glued(tokens, targets)
    assert forward.adds == 2  # one per block
    loss.backward()
    assert forward.adds == 2 + recomputed
    want_loss, want_grads = _loss_and_grads(plain)
    torch.testing.assert_close(loss.detach(), want_loss, atol=OUT_ATOL, rtol=OUT_RTOL)
    for name, p in glued.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name], atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_compiled_glue_and_blocks_match_the_models_code() -> None:
    plain = _lm()
    model = apply_compile(_lm(glue="compiled"))
    loss, grads = _loss_and_grads(model)
    want_loss, want_grads = _loss_and_grads(plain)
    torch.testing.assert_close(loss, want_loss, atol=OUT_ATOL, rtol=OUT_RTOL)
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, atol=GRAD_ATOL, rtol=GRAD_RTOL)


# The baselines' loss head.

def test_chunked_loss_is_the_cross_entropy_of_the_logits() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.nn.Parameter(torch.randn(37, 8, generator=gen))
    hidden = torch.randn(27, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 37, (27,), generator=gen)
    # 27 tokens: five chunks of 5, one of 2.
    loss = registry.chunked_cross_entropy(hidden, weight, targets, chunk_tokens=5)
    loss.backward()
    got = (loss.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad, weight.grad = None, None
    want = F.cross_entropy(hidden @ weight.T, targets)
    want.backward()
    for g, w in zip(got, (want.detach(), hidden.grad, weight.grad), strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        registry.chunked_cross_entropy(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"need hidden \(N, d\) and targets \(N,\)"):
        registry.chunked_cross_entropy(hidden, weight, targets[:5])


# The breakdown of a trace.

@pytest.mark.parametrize(("name", "kind"), [
    ("_attn_bwd_dkdv_kernel", "attention"), ("_attn_fwd_kernel", "attention"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"), ("nvjet_tst_128x256_64x4", "gemm"),
    ("void at::native::elementwise_kernel<128, 2, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>",
     "copies_casts"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, 4>", "copies_casts"),
    ("Memcpy DtoD (Device -> Device)", "copies_casts"), ("Memcpy DtoH (Device -> Pinned)", "host_transfers"),
    ("Memcpy HtoD (Pinned -> Device)", "host_transfers"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
     "elementwise"),
    ("_rms_norm_bwd_kernel", "elementwise"), ("_rope_kernel", "elementwise"), ("triton_poi_fused_mul_0", "elementwise"),
    ("triton_red_fused__to_copy_mean_pow_1", "elementwise"),
    ("void at::native::triu_tril_kernel<bool, int, false, 4, true>", "causal_mask"),
    ("_softmax_grad_kernel", "loss_optimizer_reductions"), ("_fused_adamw_kernel", "loss_optimizer_reductions"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>",
     "loss_optimizer_reductions"),
    ("ncclDevKernel_AllGather_RING_LL", "communication"), ("some_custom_kernel", "other"),
])
def test_kernels_are_sorted_by_kind(name: str, kind: str) -> None:
    assert kernel_kinds.kernel_kind(name) == kind


def _span(name: str, ts: float, dur: float, cat: str = "user_annotation", **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args, "tid": 1}


def test_breakdown_sums_kernel_time_by_kind_and_finds_idle_time() -> None:
    events = [_span("warmup", 0, 90), _span("step", 100, 1000)]
    # (name, launch on the CPU, GPU start, GPU duration): a gap of 100 us at 600-700, overlap 300-350.
    kernels = [("gemm_x", 5, 10, 50),  # launched in the warmup: not counted
               ("_attn_fwd_kernel", 110, 120, 230), ("triton_poi_fused_add_0", 150, 300, 100),
               ("void at::native::elementwise_kernel<direct_copy_kernel_cuda>", 200, 400, 200),
               ("sm90_xmma_gemm_bf16", 250, 700, 400),
               ("Memcpy DtoH (Device -> Pinned)", 260, 580, 150)]  # a copy engine's, through the gap: still idle
    for corr, (name, launch, start, dur) in enumerate(kernels):
        events.append(_span("cudaMemcpyAsync" if name.startswith("Memcpy") else "cudaLaunchKernel", launch, 2,
                            cat="cuda_runtime", correlation=corr))
        events.append(_span(name, start, dur, cat="gpu_memcpy" if name.startswith("Memcpy") else "kernel",
                            correlation=corr, stream=7))
    b = kernel_kinds.step_breakdown(events)
    assert b["kernel_ms"] == pytest.approx({**dict.fromkeys(kernel_kinds.KINDS, 0.0), "attention": 0.23,
                                            "elementwise": 0.1, "copies_casts": 0.2, "gemm": 0.4,
                                            "host_transfers": 0.15})
    assert b["kernel_total_ms"] == pytest.approx(0.93) and b["step_wall_ms"] == pytest.approx(1.0)
    # Busy: 120-400 (attention and the overlapping add), 400-600, 700-1100: 880 of 1000 us.
    assert b["idle_ms"] == pytest.approx(0.12)
    assert b["glue_share"] == pytest.approx(0.3 / 0.93)
    assert [(k["name"], k["kind"], k["count"]) for k in b["top_kernels"]] == [
        ("sm90_xmma_gemm_bf16", "gemm", 1), ("_attn_fwd_kernel", "attention", 1),
        ("void at::native::elementwise_kernel<direct_copy_kernel_cuda>", "copies_casts", 1),
        ("Memcpy DtoH (Device -> Pinned)", "host_transfers", 1), ("triton_poi_fused_add_0", "elementwise", 1)]
    assert [k["ms"] for k in b["top_kernels"]] == pytest.approx([0.4, 0.23, 0.2, 0.15, 0.1])
    top = kernel_kinds.top_kernels_markdown(b)
    assert "| sm90_xmma_gemm_bf16 | gemm | 1 | 0.4 | 0.4 | 43.0% |" in top
    table = kernel_kinds.breakdown_markdown([{"breakdown": b}, {"breakdown": None}], ["after", "none"])
    assert "| attention | 0.23 (24.7%) |" in table and "| glue share | 32.3% |" in table and "none" not in table
    assert "| host transfers (copy engines, beside the kernels) | 0.15 |" in table
    # A row from before host transfers were a kind.
    old = {**b, "kernel_ms": {k: v for k, v in b["kernel_ms"].items() if k != "host_transfers"}}
    assert "| attention | 0.23 (24.7%) |" in kernel_kinds.breakdown_markdown([{"breakdown": old}], ["old"])
    with pytest.raises(ValueError, match="no GPU kernel"):
        kernel_kinds.step_breakdown([_span("step", 0, 10)])


def test_top_kernels_sum_launches_of_one_name_and_keep_the_longest() -> None:
    events = [_span("step", 0, 10_000)]
    long_name = "void cutlass::Kernel2<" + "x" * 200 + ">"
    # 14 names, name i launched i + 1 times for 10 us each; the long name twice for 500 us each.
    launches = [(f"kernel_{i}", 10.0) for i in range(14) for _ in range(i + 1)] + [(long_name, 500.0)] * 2
    for corr, (name, dur) in enumerate(launches):
        events.append(_span("cudaLaunchKernel", 1 + corr, 1, cat="cuda_runtime", correlation=corr))
        events.append(_span(name, 1 + corr, dur, cat="kernel", correlation=corr, stream=7))
    top = kernel_kinds.step_breakdown(events)["top_kernels"]
    assert len(top) == kernel_kinds.TOP_KERNELS
    assert top[0] == {"name": long_name[:90], "kind": "gemm", "count": 2, "ms": pytest.approx(1.0)}
    assert [(k["name"], k["count"]) for k in top[1:3]] == [("kernel_13", 14), ("kernel_12", 13)]
    assert top[1]["ms"] == pytest.approx(0.14)
    assert "kernel_2" not in {k["name"] for k in top}

# The proxy tables.

def _proxy_row(impl: str, step_s: float, call: str, **extra) -> dict:
    return dict(size="8B", context_length=32768, compute_dtype="bf16", world_size=1, global_batch=1, status="ok",
                impl=impl, step_s=step_s, call_id=call, attention="triton", glue="triton", checkpoint="attention:7",
                compile_blocks=False, fused_qkv=False, **extra)


def test_proxy_rows_are_held_to_their_own_calls_baselines() -> None:
    breakdown = {"kernel_ms": {**dict.fromkeys(kernel_kinds.KINDS, 0.0), "gemm": 900.0, "elementwise": 100.0},
                 "kernel_total_ms": 1000.0, "step_wall_ms": 1000.0, "idle_ms": 0.0, "glue_share": 0.1}
    rows = [_proxy_row("ours", 2.0, "a", breakdown=breakdown), _proxy_row("torch_native", 2.8, "a"),
            _proxy_row("torch_native_compiled", 2.5, "a"), _proxy_row("ours", 1.0, "b"),  # b: no baselines
            dict(_proxy_row("ours", 0.5, "a"), world_size=2)]  # not a proxy row
    out = {(r["call_id"], r["impl"]): r for r in leaderboard.proxy_rows(rows)}
    assert len(out) == 4
    assert out["a", "ours"]["vs_strong"] == pytest.approx(0.8) and out["a", "ours"]["vs_plain"] == pytest.approx(
        2.0 / 2.8)
    assert out["a", "ours"]["glue_share"] == 0.1 and out["b", "ours"]["vs_strong"] is None
    tables = leaderboard.writeup_tables(rows)
    assert set(tables) == {"leaderboard_proxy", "leaderboard_breakdown"}  # no two-GPU rows: that table is left out
    assert "| ours (triton, triton, attention:7) |" in tables["leaderboard_breakdown"].splitlines()[0] + " |"
    # A later call's profile of the same configuration replaces it; another configuration's older profile stays,
    # after the latest call's, labelled with its call.
    later = _proxy_row("ours", 1.9, "c", breakdown={**breakdown, "glue_share": 0.05})
    before = dict(_proxy_row("ours", 2.6, "a", breakdown=breakdown), glue="model", checkpoint="attention")
    header = leaderboard.writeup_tables([*rows, before, later,
                                         _proxy_row("torch_native_compiled", 2.4, "c")])["leaderboard_breakdown"]
    assert header.splitlines()[0] == ("| kind (ms, share of kernel time) | ours (triton, triton, attention:7) | "
                                      "ours (triton, model, attention), call a |")
    assert "| glue share | 5.0% | 10.0% |" in header


@pytest.mark.slow
def test_command_runs_ours_and_the_plain_baseline_on_one_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CS336_CALL_ID", "test-call")
    out = tmp_path / "rows.jsonl"
    args = ["leaderboard", "--backend", "gloo", "--world-size", "1", "--global-batch", "1", "--warmup", "0",
            "--steps", "1", "--impl", "ours,torch_native", "--glue", "triton", "--checkpoint", "budget",
            "--memory-cap-gib", "1", "--out", str(out)]  # --profile is refused on CPU: no GPU kernels to sort
    assert cli.main(args) == 0
    ours, plain = (json.loads(line) for line in out.read_text().splitlines())
    assert (ours["impl"], plain["impl"]) == ("ours", "torch_native")
    assert ours["checkpoint_requested"] == "budget" and ours["checkpoint"] == "none"  # 1 GiB holds the tiny model
    assert (plain["checkpoint"], plain["attention"], plain["glue"], plain["optimizer"]) == (
        "all", "sdpa", "model", "torch-adamw")  # the plain recipe, whatever ours uses
    for row in (ours, plain):
        assert row["call_id"] == "test-call" and row["num_layers"] == 2 and row["world_size"] == 1
        assert row["breakdown"] is None and row["memory_cap_gib"] == 1.0
        assert row["expected_peak_gib"] > 0 and row["step_s"] > 0
    assert abs(ours["loss"] - plain["loss"]) < 1e-4  # the same model and batch, ours against PyTorch's
    assert "torch_native" in capsys.readouterr().out


# On one GPU, bf16.

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# bf16 on one GPU: norm-wise relative error of the glue kernels' step against the model's code, both in bf16
# (the kernels round where the model's ops round, so this is a few bf16 ulps accumulated over the layers).
BF16_REL_ERR = 2e-2


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("glue", ["model", "triton"])
def test_gpu_block_memory_is_what_the_allocator_holds(glue: str) -> None:
    # Sizes are multiples of the allocator's 512-byte rounding, so the count is exact up to tensors we do not model.
    batch, seq = 1, 4096
    shape = ModelConfig(d_model=1024, d_ff=2816, num_layers=1, num_heads=8, context_length=seq)
    kernels = registry.kernels("triton", glue)
    torch.manual_seed(0)
    block = TransformerBlock(1024, 8, 2816, RotaryEmbedding(seq, 128, device=torch.device("cuda")),
                             kernels=kernels, device=torch.device("cuda")).to(torch.bfloat16)
    encoder = block.attn.positional_encoder
    encoder.cos, encoder.sin = encoder.cos.float(), encoder.sin.float()
    config = TrainConfig(shape, kernels=kernels, parallelism=Parallelism(compute_dtype="bf16"), global_batch=batch)
    assert _held_by_a_forward(block, batch, seq) == pytest.approx(measure_block(config).memory.kept, rel=0.01)


def _held_by_a_forward(block: torch.nn.Module, batch: int, seq: int) -> int:
    """Bytes the allocator holds after one bf16 forward of ``block`` on (batch, seq, 1024), what its backward keeps;
    a forward + backward first compiles, autotunes and makes cuBLAS's workspace outside the measurement."""
    x = torch.randn(batch, seq, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    block(x).sum().backward()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = block(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    del out
    return held


@pytest.mark.gpu
@needs_gpu
def test_gpu_compiled_selective_block_holds_the_estimate() -> None:
    # The strong baseline's selective block (SDPA, the model's glue), compiled with its checkpoint, in bf16.
    batch, seq, cuda = 1, 4096, torch.device("cuda")
    shape = ModelConfig(d_model=1024, d_ff=2816, num_layers=1, num_heads=8, context_length=seq)
    torch.manual_seed(0)
    block = TransformerBlock(1024, 8, 2816, RotaryEmbedding(seq, 128, device=cuda),
                             kernels=registry.kernels("sdpa", "model"), device=cuda).to(torch.bfloat16)
    encoder = block.attn.positional_encoder
    encoder.cos, encoder.sin = encoder.cos.float(), encoder.sin.float()
    holder = torch.nn.Module()
    holder.layers = TransformerBlocks([block])
    apply_compile(apply_checkpointing(holder, "selective", saved_ops(shape)))
    estimate = compiled_block_memory(shape, batch, seq, dtype_bytes=2, fused_qkv=False, attention_copied=False)
    assert _held_by_a_forward(block, batch, seq) == pytest.approx(estimate.selective, rel=0.01)


@pytest.mark.gpu
@needs_gpu
def test_gpu_glue_kernels_step_matches_the_models_code_in_bf16() -> None:
    from cs336_sharding.parallelize import parallelize

    def run(glue: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        shape = ModelConfig(vocab_size=32_000, context_length=1024, d_model=512, num_layers=4, num_heads=4, d_ff=1408)
        model = build_model(shape, registry.kernels("triton", glue, "fused"), device=torch.device("cuda"))
        fsdp = parallelize(model, checkpoint="attention:2", saved=saved_ops(shape), compute_dtype=torch.bfloat16)
        gen = torch.Generator(device="cuda").manual_seed(1)
        tokens, targets = (torch.randint(0, 32_000, (2, 1024), device="cuda", generator=gen) for _ in range(2))
        loss = fsdp(tokens, targets)
        loss.backward()
        fsdp.finish_gradient_synchronization()
        return loss.detach(), {n: p.grad for n, p in fsdp.module.named_parameters()}

    loss, grads = run("triton")
    want_loss, want_grads = run("model")
    assert _rel_err(loss, want_loss) < BF16_REL_ERR
    for name, want in want_grads.items():
        assert _rel_err(grads[name], want) < BF16_REL_ERR, name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.gpu_exclusive
@pytest.mark.slow  # three implementations (one compiled), each profiled, alone on the GPU
def test_gpu_proxy_rows_at_a_small_size() -> None:
    # Ours with the glue kernels and the budget policy, and both baselines, profiled: every row within its cap.
    base = LeaderboardConfig(size="small", vocab_size=32_000, context_length=2048, global_batch=1, world_size=1,
                             glue="triton", checkpoint="budget", memory_cap_gib=12.0, warmup=1, steps=2, profile=True,
                             time_limit_s=240)
    rows = [row for impl in leaderboard.IMPLS for row in leaderboard.run_leaderboard(leaderboard.recipe(base, impl))]
    assert [r["impl"] for r in rows] == list(leaderboard.IMPLS)
    for row in rows:
        assert row["status"] == "ok" and row["within_cap"], (row["impl"], row["peak_step_gib"])
        b = row["breakdown"]
        assert b["kernel_ms"]["attention"] > 0 and b["kernel_ms"]["gemm"] > 0 and 0 < b["glue_share"] < 1
        assert abs(row["loss"] - rows[0]["loss"]) < 0.05  # one model, one batch, bf16
    assert leaderboard.proxy_rows(rows) == []  # not the proxy's shape: the proxy table leaves them out
