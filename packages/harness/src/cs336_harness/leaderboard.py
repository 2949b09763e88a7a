"""The handout's leaderboard training step (section 9), composed from this repo's pieces.

One step is forward, loss, backward, gradient synchronisation and AdamW update of a ``BasicsTransformerLM``
on ``world_size`` ranks, each holding ``global_batch / world_size`` sequences. The leaderboard
configuration is the 8B preset at vocabulary 151,936, context 32,768, global batch 2, bf16 compute, causal,
on two GPUs. :func:`build_training` composes, in this order:

1. ``BasicsTransformerLM`` with fp32 master weights, built on the rank's device;
2. attention swapped by name (:func:`cs336_harness.attention_impls.use_attention`): ``triton``, our
   FlashAttention-2 kernel, or ``sdpa`` (the swap is active while :func:`run_leaderboard` runs steps);
3. activation checkpointing of the blocks (:func:`cs336_harness.checkpointing.apply_checkpointing`);
4. the LM head replaced by :class:`FusedHeadLoss`, which owns the same weight and returns
   ``cs336_kernels.fused_linear_cross_entropy`` of the final-norm output, so the (tokens, vocab) logits
   never exist; :class:`FusedLossLM` runs the body (embeddings, blocks, final norm) and then that module.
   The head must be a module of its own: FSDP gathers a weight only inside its owner's forward;
5. :class:`cs336_sharding.fsdp.FSDP` with ``compute_dtype`` (after checkpointing, the order fsdp.py
   supports), and ``finish_gradient_synchronization()`` after each backward;
6. AdamW over the FSDP model's parameters (this rank's fp32 shards): ``cs336_kernels.fused_adamw.FusedAdamW``
   or ``torch.optim.AdamW(fused=True)``.

:func:`run_leaderboard` runs ``warmup`` untimed and ``steps`` timed steps (devices synchronised and the
ranks at a barrier before and after each) and returns one row: step time (the maximum over ranks of each
rank's median, and the maximum of all), tokens per second, model FLOPs utilisation (:func:`step_flops`
against :data:`PEAK_TFLOPS_PER_GPU`) and peak memory per rank. Past ``time_limit_s`` no new step starts
and :class:`TimeLimitExceeded` is raised. On CPU (gloo) the Triton kernels run in the Triton interpreter,
so only fp32 compute is allowed there (bf16 ``tl.dot`` is wrong in the interpreter).

    uv run cs336 leaderboard                      # CPU: tiny model, two gloo ranks, seconds
    uv run cs336 leaderboard --out rows.jsonl     # two GPUs: the leaderboard configuration
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from cs336_basics.model import BasicsTransformerLM
from cs336_comms.process_group import current_device, default_backend, run_ranks
from cs336_sharding.fsdp import FSDP

from cs336_harness.attention_impls import use_attention
from cs336_harness.bench import hidden_states
from cs336_harness.checkpointing import apply_checkpointing, parse_policy
from cs336_harness.presets import MODEL_SIZES, ModelSize, num_params
from cs336_harness.results import markdown_table

ATTENTIONS: tuple[str, ...] = ("triton", "sdpa")
OPTIMIZERS: tuple[str, ...] = ("fused", "torch")
COMPUTE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
# The bf16 matmul rate measured on one H200 (8192^3, ../shared/ANCHORS.md), the denominator of model FLOPs
# utilisation; the data sheet's dense bf16 peak is higher, so MFU against it would be lower.
PEAK_TFLOPS_PER_GPU = 772.0
GIB = 2**30

# The handout's leaderboard run, and the CPU try-out that `cs336 leaderboard` uses without CUDA.
LEADERBOARD_DEFAULTS: dict[str, Any] = dict(size="8B", vocab_size=151_936, context_length=32_768, global_batch=2,
                                            world_size=2, compute_dtype="bf16")
CPU_DEFAULTS: dict[str, Any] = dict(size="tiny", vocab_size=1_000, context_length=32, global_batch=2, world_size=2,
                                    compute_dtype="fp32")


class TimeLimitExceeded(RuntimeError):
    """The run passed its ``time_limit_s`` before all its steps were done."""


@dataclass(frozen=True)
class LeaderboardConfig:
    """One leaderboard run. Defaults are the handout's configuration (two GPUs)."""

    size: str = LEADERBOARD_DEFAULTS["size"]
    vocab_size: int = LEADERBOARD_DEFAULTS["vocab_size"]
    context_length: int = LEADERBOARD_DEFAULTS["context_length"]
    global_batch: int = LEADERBOARD_DEFAULTS["global_batch"]
    world_size: int = LEADERBOARD_DEFAULTS["world_size"]
    backend: str | None = None  # nccl with GPUs, gloo without
    compute_dtype: str = LEADERBOARD_DEFAULTS["compute_dtype"]
    attention: str = "triton"
    checkpoint: str = "all"
    optimizer: str = "fused"
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 2
    steps: int = 3
    time_limit_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.size not in MODEL_SIZES:
            raise ValueError(f"size must be one of {', '.join(MODEL_SIZES)}, got {self.size!r}")
        for name in ("vocab_size", "context_length", "global_batch", "world_size", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {self.vocab_size}")
        if self.global_batch % self.world_size != 0:
            raise ValueError(f"global_batch ({self.global_batch}) must be a multiple of world_size ({self.world_size})")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a non-negative int, got {self.warmup!r}")
        choices = {"backend": (None, "gloo", "nccl"), "compute_dtype": tuple(COMPUTE_DTYPES),
                   "attention": ATTENTIONS, "optimizer": OPTIMIZERS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {getattr(self, name)!r}")
        parse_policy(self.checkpoint)
        if not self.lr > 0 or not self.weight_decay >= 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got {self.lr} and {self.weight_decay}")
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be positive, got {self.time_limit_s}")
        if self.resolved_backend == "nccl" and self.world_size > torch.cuda.device_count():
            raise ValueError(f"world_size {self.world_size} needs that many GPUs for nccl; "
                             f"{torch.cuda.device_count()} visible")
        if self.resolved_backend == "gloo" and self.compute_dtype != "fp32":
            raise ValueError(f"compute_dtype {self.compute_dtype!r} needs GPUs: on CPU (gloo) the Triton kernels run "
                             "in the interpreter, whose bf16 dot products are wrong; use fp32")

    @property
    def resolved_backend(self) -> str:
        return self.backend or default_backend()

    @property
    def model_size(self) -> ModelSize:
        return MODEL_SIZES[self.size]


def step_flops(size: ModelSize, vocab_size: int, context_length: int, global_batch: int) -> float:
    """Model FLOPs of one training step (forward and backward), without checkpointing's recomputation.

    matmuls: 6 * tokens * non-embedding matmul parameters, where per block 4 d^2 (q, k, v, out) + 3 d d_ff
             (SwiGLU) and the LM head V d (the embedding is a lookup, not a matmul);
    attention: per layer 4 * b * h * s^2 * d_head (Q K^T and P V, 2 FLOPs per multiply-add), halved for the
             causal mask, times 3.5 for forward plus backward (the backward's five matmuls against the
             forward's two, counting FlashAttention's recomputation of the scores).
    """
    d, s, b = size.d_model, context_length, global_batch
    matmul_params = size.num_layers * (4 * d * d + 3 * d * size.d_ff) + vocab_size * d
    head_dim = d // size.num_heads
    attention_per_layer = 4 * b * size.num_heads * s**2 * head_dim / 2 * 3.5
    return 6 * b * s * matmul_params + size.num_layers * attention_per_layer


class FusedHeadLoss(nn.Module):
    """The LM head and its cross-entropy in one: owns the head's ``weight`` (vocab, d_model) and returns the
    mean loss of ``hidden @ weight.T`` against ``targets`` without materialising the logits."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight must be (vocab, d_model), got shape {tuple(weight.shape)}")
        # Imported here, not at module level: on CPU the Triton interpreter must be chosen before import.
        from cs336_kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

        self.weight = weight
        self._loss = fused_linear_cross_entropy

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(hidden.flatten(0, 1), self.weight, targets.flatten())  # (B*T, d), (B*T,)


class FusedLossLM(nn.Module):
    """A ``BasicsTransformerLM``'s modules under the same names, with ``forward(token_ids, targets) -> loss``:
    the body (embeddings, blocks, final norm), then :class:`FusedHeadLoss` in place of ``lm_head``."""

    def __init__(self, model: BasicsTransformerLM):
        super().__init__()
        self.token_embeddings = model.token_embeddings
        self.layers = model.layers
        self.ln_final = model.ln_final
        self.lm_head = FusedHeadLoss(model.lm_head.weight)

    def forward(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states(self, token_ids), targets)  # (B, T, d) -> scalar


def build_model(config: LeaderboardConfig, device: torch.device) -> BasicsTransformerLM:
    """The run's model with fp32 weights (seeded, so every rank and a reference build the same one)."""
    size = config.model_size
    torch.manual_seed(config.seed)
    return BasicsTransformerLM(config.vocab_size, config.context_length, size.d_model, size.num_layers,
                               size.num_heads, size.d_ff, device=device)


@dataclass
class Training:
    """What :func:`build_training` composed; :meth:`step` is one training step on this rank's batch."""

    model: FSDP
    optimizer: torch.optim.Optimizer

    def forward_backward(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward, loss, backward and gradient sync (each ``.grad`` is then the averaged local shard gradient);
        returns this rank's loss (not synchronised)."""
        loss = self.model(token_ids, targets)
        loss.backward()
        self.model.finish_gradient_synchronization()
        return loss.detach()

    def step(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:meth:`forward_backward`, then the optimizer update; returns this rank's loss (not synchronised)."""
        loss = self.forward_backward(token_ids, targets)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def build_training(config: LeaderboardConfig, device: torch.device) -> Training:
    """Steps 1 and 3-6 of the module docstring; the attention swap (2) is :func:`use_attention`'s, around
    the steps. Call it on every rank of an initialised process group (FSDP broadcasts rank 0's weights)."""
    model = apply_checkpointing(build_model(config, device), config.checkpoint)
    fsdp = FSDP(FusedLossLM(model), compute_dtype=COMPUTE_DTYPES[config.compute_dtype])
    params = list(fsdp.parameters())
    if config.optimizer == "fused":
        from cs336_kernels.fused_adamw import FusedAdamW

        optimizer: torch.optim.Optimizer = FusedAdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=True)
    return Training(fsdp, optimizer)


def make_batch(config: LeaderboardConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Random input and target token ids of the whole global batch, each (global_batch, context_length), on CPU;
    rank r trains on rows ``[r * B / n, (r + 1) * B / n)``."""
    g = torch.Generator().manual_seed(1000 + config.seed)
    shape = (config.global_batch, config.context_length)
    return (torch.randint(0, config.vocab_size, shape, generator=g),
            torch.randint(0, config.vocab_size, shape, generator=g))


def rank_batch(config: LeaderboardConfig, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of :func:`make_batch`, on ``device``."""
    per_rank = config.global_batch // config.world_size
    inputs, targets = make_batch(config)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return inputs[rows].to(device), targets[rows].to(device)


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    packed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return packed.tolist()


def _rank_main(rank: int, world_size: int, config: LeaderboardConfig, out_path: str) -> None:
    start = time.perf_counter()
    device = current_device()
    cuda = device.type == "cuda"
    if not cuda:
        # Before any kernel module is imported in this (fresh) process; see the module docstring.
        os.environ.setdefault("TRITON_INTERPRET", "1")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()

    def check_time(done: int) -> None:
        # Every rank must take the same decision, or one would wait forever in the next step's collectives.
        over = _max_over_ranks([time.perf_counter() - start], device)[0] > config.time_limit_s
        if over:
            raise TimeLimitExceeded(
                f"time limit of {config.time_limit_s:g} s reached after {done} of {config.warmup + config.steps} "
                "steps (model build included); raise --time-limit-s or lower --steps/--warmup")

    training = build_training(config, device)
    inputs, targets = rank_batch(config, rank, device)
    sync()
    peak_init = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    times: list[float] = []
    try:
        with use_attention(config.attention):
            for i in range(config.warmup):
                check_time(i)
                training.step(inputs, targets)
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            for i in range(config.steps):
                check_time(config.warmup + i)
                sync()
                t0 = time.perf_counter()
                loss = training.step(inputs, targets)
                sync()
                times.append(time.perf_counter() - t0)
    except TimeLimitExceeded as e:
        # Every rank stops here together; the caller raises the message again.
        if rank == 0:
            Path(out_path).write_text(json.dumps({"time_limit_exceeded": str(e)}))
        return
    peak_step = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    loss_sum = loss.float().reshape(1)
    dist.all_reduce(loss_sum)  # gloo has no AVG
    step_s, step_max_s = _max_over_ranks([statistics.median(times), max(times)], device)
    peaks = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world_size)]
    dist.all_gather(peaks, torch.tensor([peak_init or 0.0, peak_step or 0.0], dtype=torch.float64, device=device))
    if rank == 0:
        result = {"loss": loss_sum.item() / world_size, "step_s": step_s, "step_max_s": step_max_s,
                  "step_s_all_rank0": [round(t, 6) for t in times]}
        if cuda:
            result["peak_init_gib_per_rank"] = [p[0].item() for p in peaks]
            result["peak_step_gib_per_rank"] = [p[1].item() for p in peaks]
        Path(out_path).write_text(json.dumps(result))


def run_leaderboard(config: LeaderboardConfig, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run ``config`` on its ranks; one row (config, timings, throughput, MFU, memory), or [] on a torchrun rank
    other than 0.

    Raises:
        TimeLimitExceeded: if a step would start after ``time_limit_s`` (every rank stops before it).
    """
    if progress is not None:
        progress(f"leaderboard: {config.size}, context {config.context_length}, global batch {config.global_batch}, "
                 f"{config.world_size} ranks ({config.resolved_backend}), {config.compute_dtype}, attention "
                 f"{config.attention}, checkpoint {config.checkpoint}, optimizer {config.optimizer}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        # The group's timeout bounds a hung collective; the time limit is checked between steps.
        if not run_ranks(_rank_main, config.world_size, config, str(out), backend=config.resolved_backend,
                         timeout_s=config.time_limit_s + 60):
            return []
        result = json.loads(out.read_text())
    if "time_limit_exceeded" in result:
        raise TimeLimitExceeded(result["time_limit_exceeded"])
    size = config.model_size
    flops = step_flops(size, config.vocab_size, config.context_length, config.global_batch)
    tokens = config.global_batch * config.context_length
    on_gpu = config.resolved_backend == "nccl"
    row: dict[str, Any] = {**asdict(config), **asdict(size), "backend": config.resolved_backend,
                           "params": num_params(size, config.vocab_size),
                           "tokens_per_step": tokens, "model_flops_per_step": flops, **result}
    row["tokens_per_s"] = tokens / row["step_s"]
    row["mfu"] = flops / (row["step_s"] * config.world_size * PEAK_TFLOPS_PER_GPU * 1e12) if on_gpu else None
    if on_gpu:
        row["peak_step_gib"] = max(row["peak_step_gib_per_rank"])
        row["peak_init_gib"] = max(row["peak_init_gib_per_rank"])
    row["status"] = "ok"
    return [row]


TABLE_COLUMNS = ("size", "context_length", "global_batch", "world_size", "compute_dtype", "attention", "checkpoint",
                 "optimizer", "loss", "step_s", "step_max_s", "tokens_per_s", "mfu", "peak_step_gib")

_WRITEUP_COLUMNS = ("attention", "checkpoint", "optimizer", "step_s", "step_max_s", "tokens_per_s", "mfu",
                    "peak_init_gib", "peak_step_gib", "commit")
_WRITEUP_HEADERS = ("attention", "checkpointing", "AdamW", "step (s)", "slowest step (s)", "tokens/s", "MFU",
                    "peak at init (GiB)", "peak in step (GiB)", "commit")


def writeup_tables(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The writeup's table by marker name (``<!-- table:leaderboard -->``): the leaderboard-configuration rows
    (8B, context 32768, batch 2, two ranks, bf16) fastest first; rows of other configurations are left out."""
    chosen = [r for r in rows if (r["size"], r["context_length"], r["global_batch"], r["world_size"],
                                  r["compute_dtype"]) == ("8B", 32768, 2, 2, "bf16") and r.get("status") == "ok"]
    chosen.sort(key=lambda r: r["step_s"])
    return {"leaderboard": markdown_table(chosen, _WRITEUP_COLUMNS, _WRITEUP_HEADERS, floatfmt=".4g")}


__all__ = ["LeaderboardConfig", "FusedHeadLoss", "FusedLossLM", "Training", "TimeLimitExceeded", "build_model",
           "build_training", "make_batch", "rank_batch", "run_leaderboard", "step_flops", "ATTENTIONS", "OPTIMIZERS",
           "COMPUTE_DTYPES", "LEADERBOARD_DEFAULTS", "CPU_DEFAULTS", "PEAK_TFLOPS_PER_GPU", "TABLE_COLUMNS",
           "writeup_tables"]
