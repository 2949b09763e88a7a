"""Host memory: what a run on the CPU needs against what this machine can give it, checked before it starts.

On CUDA a configuration too large for the GPU raises ``torch.OutOfMemoryError``, which ``cs336 bench`` turns into a
row with status ``oom``. On a CPU nothing raises in time: the machine swaps, then the kernel's out-of-memory killer
ends some process, minutes later. So a command that computes on the CPU first adds up what its run must hold
(:class:`HostMemoryNeed`) and compares that with what Linux can still hand out (``MemAvailable`` in
``/proc/meminfo``):

- a training step's peak (:func:`step_peak`), the larger of its two: at the start of the backward the fp32 weights
  (4 bytes per parameter) and the activations, at the optimizer's update the weights, their gradients (4 bytes)
  and AdamW's two moments (8 bytes; every optimizer the studies build is an AdamW);
- activations (:func:`activation_bytes`): what the blocks keep for the backward (:func:`block_floor`, the least any
  implementation of the block keeps) under the run's checkpointing
  (:func:`cs336_sharding.checkpointing.activation_peak_bytes`), the (batch, heads, seq, seq) score matrices of an
  attention that builds them, and the fp32 logits of an unfused loss;
- each spawned rank's own memory besides those tensors (:data:`RANK_BASE_BYTES`, measured).

The sums leave out the allocator's slack, temporaries, autocast's weight copies and what the two peaks share (the
gradients grow while the activations are freed), so they are lower bounds: a run they refuse cannot fit, and a run
they pass may still be tight.

    need = HostMemoryNeed("size 8B, context 128", step_peak(num_params, activations, backward=True, adamw=True))
    reason = need.shortfall()        # None, or one line: what it needs and what there is
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cs336_basics.config import ModelConfig
from cs336_comms.process_group import launched_by_torchrun
from cs336_sharding.checkpointing import BlockMemory, activation_peak_bytes, parse_policy

from cs336_harness.device import GIB

# A spawned rank's own memory besides the tensors the checks count (torch imported, the process group joined, the
# profiler's and the step's buffers): the larger of a rank's private memory and its share of all the ranks' PSS, less
# those tensors, was at most 0.527 GiB over `cs336 ddp` and `cs336 collectives` on 2 and 8 gloo ranks (the most
# on 2 ranks, which split the shared libraries' pages two ways) (writeup/results/host_memory.jsonl, from
# tools/rank_host_memory.py; tests/test_host_memory.py holds this to it).
RANK_BASE_BYTES = 11 * GIB // 20

# Attention that materialises the (batch, heads, seq, seq) scores: how many such matrices a block keeps for its
# backward (the model's softmax keeps its exp and its output), and how many more its forward holds at once.
_SCORE_MATRICES: dict[str, tuple[int, int]] = {"eager": (2, 2), "annotated": (2, 2), "compiled": (1, 1)}
_MEMINFO = Path("/proc/meminfo")


def available_host_bytes() -> int:
    """What Linux can give new allocations without swapping (``MemAvailable``)."""
    for line in _MEMINFO.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"{_MEMINFO} has no MemAvailable line (Linux 3.14 and later have one)")


def largest(*moments: Mapping[str, float]) -> dict[str, float]:
    """Of the moments given (bytes held then, by part), the one that holds the most."""
    return dict(max(moments, key=lambda parts: sum(parts.values())))


def step_peak(num_params: float, activations: float, *, backward: bool, adamw: bool) -> dict[str, float]:
    """The peak of a training step of ``num_params`` fp32 parameters, by part: the larger of the start of the backward
    (weights and activations; the gradients are yet to grow, and before the first update AdamW has no state) and
    the optimizer's update (weights, gradients and AdamW's two moments; the activations are gone). Without a
    backward, the weights and the forward's activations."""
    weights = {"weights": 4 * num_params}
    if not backward:
        return {**weights, "activations": activations}
    update = {**weights, "gradients": 4 * num_params, **({"AdamW state": 8 * num_params} if adamw else {})}
    return largest({**weights, "activations": activations}, update)


def block_floor(config: ModelConfig, batch: int, dtype_bytes: int) -> BlockMemory:
    """The least one ``cs336_basics`` block on ``batch`` sequences keeps for its backward, however its norms, RoPE,
    attention and gate run (N tokens, d = d_model, f = d_ff, e = ``dtype_bytes``): not checkpointed, the inputs of
    its matmuls (the normed input for q, k, v and again for w1, w3, the attention output, the gate's output), the
    attention op's q, k and v, the gate's two inputs and the block's output, ``e N (7 d + 3 f)``; checkpointed
    saving the attention's outputs, the block's output, the attention output and its fp32 log-sum-exp; checkpointed,
    the block's output (and no more counted for ``selective``, which keeps the matmuls' outputs too). Its backward's
    working set is at least the gradient of its output, ``e N d``."""
    n, d, e = batch * config.context_length, config.d_model, dtype_bytes
    out = e * n * d
    attention = 2 * out + 4 * n * config.num_heads
    return BlockMemory(kept=e * n * (7 * d + 3 * config.d_ff), selective=attention, attention=attention,
                       checkpointed=out, working=out)


def activation_bytes(config: ModelConfig, batch: int, *, dtype_bytes: int, attention: str, checkpoint: str,
                     backward: bool, fused_loss: bool) -> int:
    """The activations of a ``BasicsTransformerLM`` step on ``batch`` sequences of ``config.context_length``
    tokens at its peak: with a backward, what the blocks keep under ``checkpoint`` and the last block's backward
    holds (:func:`~cs336_sharding.checkpointing.activation_peak_bytes`; the policies that recompute more than one
    block at a time, and ``selective``, are counted as ``all``, the least any policy keeps, with no block's score
    matrices kept: a lower bound; ``offload`` ones as ``none``: here, in host memory, the copies weigh what the
    blocks would keep); without, one block's input and output. ``attention`` is a name of
    :data:`cs336_harness.registry.ATTENTIONS`; ``eager``, ``annotated`` and ``compiled`` build
    the score matrices. An unfused loss adds the fp32 logits."""
    seq, layers = config.context_length, config.num_layers
    block = block_floor(config, batch, dtype_bytes)
    spec = parse_policy(checkpoint)
    if spec.kind == "offload":
        spec = parse_policy("none")
    elif spec.kind not in ("none", "all", "first", "attention"):
        spec = parse_policy("all")
    kept_blocks = {"none": layers, "all": 0}.get(spec.kind, layers - min(spec.arg or layers, layers))
    kept_scores, working_scores = _SCORE_MATRICES.get(attention, (0, 0))
    scores = batch * config.num_heads * seq * seq * dtype_bytes
    if backward:
        blocks = activation_peak_bytes(block, layers, spec) + (kept_blocks * kept_scores + working_scores) * scores
    else:
        blocks = 2 * block.checkpointed + working_scores * scores
    logits = 0 if fused_loss else 4 * batch * seq * config.vocab_size
    return blocks + logits


def _gib(n: float) -> str:
    return f"{n / GIB:.0f}" if n >= 100 * GIB else f"{n / GIB:.3g}"


@dataclass(frozen=True)
class HostMemoryNeed:
    """What a run must hold in host memory: ``per_rank`` (bytes by what they are for) in each of ``ranks``
    processes on this machine, plus :data:`RANK_BASE_BYTES` each if ``spawned`` (new processes; the command's own
    process, or ranks torchrun already started, are part of what is no longer available)."""

    what: str  # the run in words, for the message: "size 8B, context 128, batch 4"
    per_rank: Mapping[str, float]
    ranks: int = 1
    spawned: bool = False

    @property
    def rank_bytes(self) -> float:
        return sum(self.per_rank.values()) + (RANK_BASE_BYTES if self.spawned else 0)

    @property
    def total_bytes(self) -> float:
        return self.ranks * self.rank_bytes

    def shortfall(self, available: int | None = None) -> str | None:
        """None if the run fits in ``available`` bytes (default: :func:`available_host_bytes`), else one line: what
        it needs, for what, and what there is (with several ranks, how many would fit)."""
        available = available_host_bytes() if available is None else available
        if self.total_bytes <= available:
            return None
        parts = {**({"the process": RANK_BASE_BYTES} if self.spawned else {}), **self.per_rank}
        detail = ", ".join(f"{name} {_gib(n)}" for name, n in parts.items())
        line = (f"{self.what} needs at least {_gib(self.total_bytes)} GiB of host memory ("
                + (f"{self.ranks} ranks of {_gib(self.rank_bytes)} GiB: {detail}" if self.ranks > 1 else detail)
                + f"), and {_gib(available)} GiB is available")
        fit = int(available // self.rank_bytes)
        if self.ranks > 1 and fit >= 1:
            line += f": at most {fit} of these ranks fit" if fit > 1 else ": one of these ranks fits"
        return line

    def check(self) -> None:
        """Raises ValueError with :meth:`shortfall`'s line if the run cannot fit in what is available now."""
        reason = self.shortfall()
        if reason:
            raise ValueError(reason)


def ranks_here(world_size: int) -> tuple[int, bool]:
    """How many of ``world_size`` ranks run on this machine, and whether they are yet to be spawned: all of them,
    spawned, for a plain command; torchrun's local ones, already running, under torchrun."""
    if launched_by_torchrun():
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])), False
    return world_size, True
