"""The handout's leaderboard training step (section 9), composed from this repo's pieces.

One step is forward, loss, backward, gradient synchronisation and AdamW update of a ``BasicsTransformerLM``
on ``world_size`` ranks, each holding ``global_batch / world_size`` sequences. The leaderboard
configuration is the 8B preset at vocabulary 151,936, context 32,768, global batch 2, bf16 compute, causal,
on two GPUs. :func:`build_training` composes:

1. ``BasicsTransformerLM`` with fp32 master weights on the rank's device, with its attention: ``triton``, our
   FlashAttention-2 kernel, or ``sdpa``;
2. :func:`cs336_sharding.parallelize.parallelize`: activation checkpointing of the blocks, the LM head replaced
   by the fused linear + cross-entropy loss (the (tokens, vocab) logits never exist), and our FSDP with
   ``compute_dtype``; ``finish_gradient_synchronization()`` after each backward;
3. AdamW over the FSDP model's parameters (this rank's fp32 shards), by the names of
   :mod:`cs336_harness.studies.optimizers`: our Triton ``fused-adamw`` or ``torch-adamw`` (fused).

:func:`run_leaderboard` runs ``warmup`` untimed and ``steps`` timed steps (devices synchronised and the
ranks at a barrier before and after each) and returns one row: step time (the maximum over ranks of each
rank's median, and the maximum of all), tokens per second, model FLOPs utilisation (:func:`step_flops`
against the H200's measured bf16 matmul rate) and peak memory per rank. Past ``time_limit_s`` no new step starts
and :class:`TimeLimitExceeded` is raised. On CPU (gloo) the Triton kernels run in the Triton interpreter,
so only fp32 compute is allowed there (bf16 ``tl.dot`` is wrong in the interpreter).

    uv run cs336 leaderboard                      # CPU: tiny model, two gloo ranks, seconds
    uv run cs336 leaderboard --out rows.jsonl     # two GPUs: the leaderboard configuration
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from cs336_basics.config import PRESETS, ModelConfig
from cs336_basics.model import BasicsTransformerLM
from cs336_comms.process_group import current_device, default_backend, run_ranks
from cs336_sharding.checkpointing import parse_policy
from cs336_sharding.fsdp import FSDP
from cs336_sharding.parallelize import parallelize

from cs336_harness.analysis.tables import markdown_table
from cs336_harness.device import DTYPES, GIB, H200_BF16_MATMUL_FLOPS
from cs336_harness.studies.attention_impls import get_attention
from cs336_harness.studies.optimizers import build_optimizer

ATTENTIONS: tuple[str, ...] = ("triton", "sdpa")
OPTIMIZERS: tuple[str, ...] = ("fused-adamw", "torch-adamw")
COMPUTE_DTYPES: tuple[str, ...] = ("bf16", "fp32")

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
    optimizer: str = "fused-adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 2
    steps: int = 3
    time_limit_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.size not in PRESETS:
            raise ValueError(f"size must be one of {', '.join(PRESETS)}, got {self.size!r}")
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
        choices = {"backend": (None, "gloo", "nccl"), "compute_dtype": COMPUTE_DTYPES,
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
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_preset(self.size, vocab_size=self.vocab_size, context_length=self.context_length)


def step_flops(config: ModelConfig, global_batch: int) -> float:
    """Model FLOPs of one training step (forward and backward), without checkpointing's recomputation.

    matmuls: 6 * tokens * non-embedding matmul parameters, where per block 4 d^2 (q, k, v, out) + 3 d d_ff
             (SwiGLU) and the LM head V d (the embedding is a lookup, not a matmul);
    attention: per layer 4 * b * h * s^2 * d_head (Q K^T and P V, 2 FLOPs per multiply-add), halved for the
             causal mask, times 3.5 for forward plus backward (the backward's five matmuls against the
             forward's two, counting FlashAttention's recomputation of the scores).
    """
    d, s, b = config.d_model, config.context_length, global_batch
    matmul_params = config.num_layers * (4 * d * d + 3 * d * config.d_ff) + config.vocab_size * d
    attention_per_layer = 4 * b * config.num_heads * s**2 * config.head_dim / 2 * 3.5
    return 6 * b * s * matmul_params + config.num_layers * attention_per_layer



def build_model(config: LeaderboardConfig, device: torch.device) -> BasicsTransformerLM:
    """The run's model with fp32 weights and its attention (seeded, so every rank and a reference build the same
    one)."""
    torch.manual_seed(config.seed)
    return BasicsTransformerLM.from_config(config.model_config, attention=get_attention(config.attention),
                                           device=device)


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
    """The steps of the module docstring. Call it on every rank of an initialised process group (FSDP broadcasts
    rank 0's weights)."""
    fsdp = parallelize(build_model(config, device), checkpoint=config.checkpoint,
                       compute_dtype=DTYPES[config.compute_dtype], fused_loss=True)
    return Training(fsdp, build_optimizer(config.optimizer, fsdp.parameters(), config.lr, config.weight_decay))


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


def _rank_main(rank: int, world_size: int, config: LeaderboardConfig) -> dict[str, Any]:
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
        return {"time_limit_exceeded": str(e)}
    peak_step = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    loss_sum = loss.float().reshape(1)
    dist.all_reduce(loss_sum)  # gloo has no AVG
    step_s, step_max_s = _max_over_ranks([statistics.median(times), max(times)], device)
    peaks = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world_size)]
    dist.all_gather(peaks, torch.tensor([peak_init or 0.0, peak_step or 0.0], dtype=torch.float64, device=device))
    result = {"loss": loss_sum.item() / world_size, "step_s": step_s, "step_max_s": step_max_s,
              "step_s_all_rank0": [round(t, 6) for t in times]}
    if cuda:
        result["peak_init_gib_per_rank"] = [p[0].item() for p in peaks]
        result["peak_step_gib_per_rank"] = [p[1].item() for p in peaks]
    return result


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
    # The group's timeout bounds a hung collective; the time limit is checked between steps.
    result = run_ranks(_rank_main, config.world_size, config, backend=config.resolved_backend,
                       timeout_s=config.time_limit_s + 60)
    if result is None:  # a torchrun rank other than 0
        return []
    if "time_limit_exceeded" in result:
        raise TimeLimitExceeded(result["time_limit_exceeded"])
    model_config = config.model_config
    flops = step_flops(model_config, config.global_batch)
    tokens = config.global_batch * config.context_length
    on_gpu = config.resolved_backend == "nccl"
    dims = {k: getattr(model_config, k) for k in ("d_model", "d_ff", "num_layers", "num_heads")}
    row: dict[str, Any] = {**asdict(config), **dims, "backend": config.resolved_backend,
                           "params": model_config.num_params,
                           "tokens_per_step": tokens, "model_flops_per_step": flops, **result}
    row["tokens_per_s"] = tokens / row["step_s"]
    row["mfu"] = flops / (row["step_s"] * config.world_size * H200_BF16_MATMUL_FLOPS) if on_gpu else None
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
    return {"leaderboard": markdown_table(chosen, list(zip(_WRITEUP_COLUMNS, _WRITEUP_HEADERS, strict=True)),
                                          floatfmt=".4g")}


