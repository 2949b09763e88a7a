"""What each piece of a training step holds, counted on fake tensors for whatever kernels, loss and optimizer the step
runs (:func:`measure_step`): one block in each checkpointing mode (:func:`measure_block`; where Inductor decides
what is saved, compiled blocks or compiled glue, the byte model :func:`compiled_block_memory`), the final norm, the
LM head and its loss (:func:`measure_head`), and the optimizer's state and update (:func:`measure_optimizer`). Each
piece is built with the step's kernels (a block by :func:`cs336_harness.train_config.build_block`) on fake tensors
and its live storages counted (:class:`cs336_harness.analysis.live_memory.LiveMemory`) through a forward and a
backward, or an update: nothing is computed, so a block of the 8B model at context 32,768 takes a second.
:mod:`cs336_harness.memory_plan` puts them together into the step's peak.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
from cs336_basics.config import ModelConfig
from cs336_basics.model import LMHead, RMSNorm, TransformerBlocks
from cs336_sharding.checkpointing import BlockMemory, apply_checkpointing
from torch import nn

from cs336_harness.analysis.live_memory import LiveMemory, fake_tensors
from cs336_harness.train_config import TrainConfig, build_block, build_model, saved_ops

# The checkpointing modes a block is measured in, by the policy that puts a single block in that mode.
_MODES = {"selective": "selective", "attention": "attention", "checkpointed": "all"}


def compiled(config: TrainConfig) -> bool:
    """Whether Inductor decides what ``config``'s blocks save: compiled blocks, or a piece of the glue that is a
    ``torch.compile`` wrapper."""
    k = config.kernels
    glue = (k.norm, k.add_norm, k.rotary, k.gate)
    return config.parallelism.compile != "none" or any(hasattr(fn, "_torchdynamo_orig_callable") for fn in glue)


class MeasuredBlock(NamedTuple):
    """What :func:`measure_block` counts of one block: its ``memory`` (with whether its forward keeps its own input:
    a norm that keeps an fp32 copy of a bf16 input does not, so the block before it need not keep its output);
    whether the output projection reads a copy of the attention's output (``attention_copied``: a heads-first output,
    which the compiled byte model needs)."""

    memory: BlockMemory
    attention_copied: bool


def _saved_storages(saved: set[int]) -> torch.autograd.graph.saved_tensors_hooks:
    """A context in which autograd records in ``saved`` the storage of every tensor it saves for backward."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.add(tensor.untyped_storage()._cdata)
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def measure_block(config: TrainConfig) -> MeasuredBlock:
    """What one block of ``config``'s model keeps with its kernels on this rank's batch, in the compute dtype and
    with its weights already there (as our FSDP gathers them: the 2-D weights in the compute dtype, the norms' in
    fp32, counted with the step), traced on fake tensors:

    - ``kept``: the live storages after a forward, its output included;
    - ``selective``, ``attention``, ``checkpointed``: the same under a checkpointed segment that keeps the matmuls'
      and the fused attention's outputs (:func:`cs336_harness.train_config.saved_ops`), the fused attention's alone,
      and nothing;
    - ``working``: the peak of the backward above what lives when it starts (what the block keeps and the gradient
      reaching its output, which takes the place of the output, freed in a step by then).

    Compiled kernels run as their eager code here.
    """
    m = config.model
    dtype = config.compute_dtype
    copied: list[bool] = []
    attention = config.kernels.attention

    def attention_probe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
        out = attention(q, k, v, is_causal)  # (..., H, T, Dh); the projection reads (..., T, H * Dh)
        copied.append(not out.transpose(-3, -2).is_contiguous())
        return out

    kernels = dataclasses.replace(config.kernels, attention=attention_probe)
    saved: set[int] = set()
    with torch.compiler.set_stance("force_eager"), fake_tensors():
        block = build_block(m, kernels, fused_qkv=config.fused_qkv)
        for weight in block.parameters():
            if weight.dim() == 2:
                weight.data = weight.data.to(dtype)
        x = torch.empty(config.batch_per_rank, m.context_length, m.d_model, dtype=dtype, requires_grad=True)
        with LiveMemory() as live:
            with _saved_storages(saved):
                out = block(x)
            kept = live.live_bytes
            gradient = torch.empty_like(out)
            start = live.live_bytes
            live.reset_peak()
            out.backward(gradient)
            working = live.peak_bytes - start
            del out, gradient
        block.zero_grad(set_to_none=True)
        tiers = {}
        for tier, policy in _MODES.items():
            holder = nn.Module()
            holder.layers = TransformerBlocks([block])
            apply_checkpointing(holder, policy, saved_ops(m))
            with LiveMemory() as live:
                out = holder.layers(x)  # held: its graph holds what the segment saved
                tiers[tier] = live.live_bytes
                del out
        saves_input = x.untyped_storage()._cdata in saved
    return MeasuredBlock(BlockMemory(kept=kept, working=working, saves_input=saves_input, **tiers), copied[0])


def compiled_block_memory(shape: ModelConfig, batch: int, seq: int, *, dtype_bytes: int, fused_qkv: bool,
                          attention_copied: bool) -> BlockMemory:
    """:class:`~cs336_sharding.checkpointing.BlockMemory` of one ``cs336_basics`` block whose forward Inductor
    compiled (RMSNorm, RoPE attention with a fused attention op, RMSNorm, SwiGLU), on ``batch`` sequences of ``seq``
    tokens in a compute dtype of ``dtype_bytes``. Inductor's partitioner keeps the inputs of the norms and of the gate
    and recomputes the rest, as our kernels do, so with N = batch * seq tokens, d = d_model, f = d_ff, h = heads,
    e = dtype_bytes, autograd keeps:

    - both norms: their input (the block input for the first, free here; the residual sum h for the second: e N d) and
      rstd (4 N); RoPE: the positions (8 seq, int64);
    - the q / k / v projections keep the normed input (e N d); the attention op keeps rotated q and k, v and its
      output (4 e N d) and the fp32 log-sum-exp (4 N h); with ``fused_qkv`` v is a view of the (N, 3 d) projection
      output, which it keeps whole (2 e N d more), and the matmul keeps the concatenated (3 d, d) weight (3 e d^2);
    - the output projection keeps the heads' outputs in (N, d) layout: a view of the attention output, or a copy
      (e N d) where that output is heads-first (``attention_copied``, :func:`measure_block`);
    - SwiGLU: w1 and w3 keep the normed input (e N d); the gate keeps a and b (2 e N f); w2 its output (e N f);
    - the block's output (e N d).

    Checkpointed, a compiled block has its checkpoint inside the compiled code
    (:meth:`cs336_sharding.checkpointing.CheckpointedBlocks.compile_blocks`), so the partitioner saves exactly what
    the segment's policy keeps and recomputes the rest from that, the block's input and its weights (RoPE's tables
    are views of the model's buffers), all of which the step counts elsewhere:

    - ``selective`` (the op policy: the matmuls' and the attention op's outputs): the output, the attention op's
      output and log-sum-exp (e N d + 4 N h), and the outputs of the matmuls the recomputation uses: q, k and v (one
      (N, 3 d) output with ``fused_qkv``), the output projection's, w1's and w3's (4 e N d + 2 e N f); not w2's,
      which only the residual add reads (:class:`cs336_sharding.checkpointing.SavedOps`). The norms, RoPE, a
      heads-first output's copy and the gate are recomputed;
    - ``attention``: the output and the attention op's output and log-sum-exp;
    - ``checkpointed``: the output.

    ``working``: the backward's peak is in the gate's backward, holding w2's weight gradient (e d f) and the gate's
    two input gradients (2 e N f).
    """
    d, f, h = shape.d_model, shape.d_ff, shape.num_heads
    n, e = batch * seq, dtype_bytes
    out, lse = e * n * d, 4 * n * h
    norms, rope, gate = e * n * d + 2 * 4 * n, 8 * seq, 2 * e * n * f
    copy = e * n * d if attention_copied else 0
    attention = (1 + 4) * e * n * d + copy + lse + ((2 * n + 3 * d) * e * d if fused_qkv else 0)
    kept = norms + rope + attention + e * n * d + gate + e * n * f + out
    attention_kept = out + e * n * d + lse
    return BlockMemory(kept=kept, selective=attention_kept + 4 * e * n * d + 2 * e * n * f, attention=attention_kept,
                       checkpointed=out, working=e * d * f + 2 * e * n * f)


def block_memory(config: TrainConfig) -> BlockMemory:
    """What one block of ``config`` keeps in each mode and whether it keeps its input: :func:`measure_block`, or
    :func:`compiled_block_memory` where the block's forward or a piece of its glue is compiled (which keeps the
    norms' inputs)."""
    measured = measure_block(config)
    if not compiled(config):
        return measured.memory
    return compiled_block_memory(config.model, config.batch_per_rank, config.model.context_length,
                                 dtype_bytes=config.compute_dtype.itemsize, fused_qkv=config.fused_qkv,
                                 attention_copied=measured.attention_copied)


@dataclass(frozen=True)
class HeadMemory:
    """What the end of the step adds to memory on this rank's batch: the final norm, the LM head and its loss (any of
    :data:`cs336_harness.registry.LOSSES`, or a user's), above their input (the last block's output, which the blocks
    count) and their weights (which the plan counts as the wrapper holds them), as :func:`measure_head` counts them:

    - ``forward``: the peak of their forward, the loss included (the standard loss's logits and their fp32
      log-softmax, the chunked loss's one chunk, the fused loss's gradients);
    - ``backward``: the peak of the loss's backward, up to the gradient for the final norm's output;
    - ``handed``: what is alive then: that gradient, the head's weight gradient in the compute dtype (which the
      wrapper takes over) and whatever the loss still holds;
    - ``norm``: the peak of the final norm's backward, without the head's weight gradient (gone to the wrapper's
      buffers by then);
    - ``saves_input``: whether the final norm keeps its input itself (else the last block's output is freed once the
      norm has run).
    """

    forward: int
    backward: int
    handed: int
    norm: int
    saves_input: bool


def measure_head(config: TrainConfig) -> HeadMemory:
    """:class:`HeadMemory` of ``config``: its final norm (fp32 weight, as our FSDP keeps a 1-D weight) and LM head (a
    compute-dtype weight, as gathered) with its kernels' norm and loss, on fake tensors of this rank's batch, their
    storages counted (:class:`~cs336_harness.analysis.live_memory.LiveMemory`) through a forward and a backward.
    Compiled kernels run as their eager code here."""
    m, dtype = config.model, config.compute_dtype
    k = config.kernels
    at_hidden_gradient: list[tuple[int, int]] = []
    saved: set[int] = set()
    with torch.compiler.set_stance("force_eager"), fake_tensors():
        norm = RMSNorm(m.d_model, norm=k.norm)
        head = LMHead(m.d_model, m.vocab_size, dtype=dtype, loss=k.loss)
        x = torch.empty(config.batch_per_rank, m.context_length, m.d_model, dtype=dtype, requires_grad=True)
        targets = torch.empty(config.batch_per_rank, m.context_length, dtype=torch.int64)
        with LiveMemory() as live:

            def handed(gradient: torch.Tensor) -> None:
                at_hidden_gradient.append((live.peak_bytes, live.live_bytes))
                live.reset_peak()

            with _saved_storages(saved):
                hidden = norm(x)
            hidden.register_hook(handed)
            loss = head(hidden, targets)
            del hidden
            forward = live.peak_bytes
            live.reset_peak()
            loss.backward()
            norm_peak = live.peak_bytes - head.weight.grad.untyped_storage().nbytes()
        saves_input = x.untyped_storage()._cdata in saved
    (backward, handed_bytes), = at_hidden_gradient
    return HeadMemory(forward=forward, backward=backward, handed=handed_bytes, norm=norm_peak,
                      saves_input=saves_input)


def measure_optimizer(config: TrainConfig) -> tuple[int, int]:
    """This rank's optimizer state, and the peak of its update above the weights, gradients and that state (its
    temporaries), counted on fake tensors: ``config``'s optimizer built over parameters shaped as our FSDP hands them
    over (a 2-D weight flat, its 1 / world_size share; the others whole, fp32), a step taken to make its state, then
    the step counted."""
    w = config.parallelism.world_size
    shapes = [p.shape for p in build_model(config.model, device=torch.device("meta")).parameters()]
    with fake_tensors():
        params = [nn.Parameter(torch.empty(-(-shape.numel() // w) if len(shape) == 2 else shape.numel()))
                  for shape in shapes]
        for p in params:
            p.grad = torch.empty_like(p)
        optimizer = config.optimizer.build(params)
        with LiveMemory(host_read=1) as live:  # torch's optimizers read their count of steps taken
            optimizer.step()
            state = live.live_bytes
            live.reset_peak()
            optimizer.step()
    return state, live.peak_bytes - state


@dataclass(frozen=True)
class StepMemory:
    """What the plan counts of a step on fake tensors: ``block`` (what one block keeps in each mode and whether it
    keeps its input, :func:`block_memory`), ``head`` (the end of the step, :func:`measure_head`),
    ``optimizer_state`` and ``optimizer_update`` (this rank's optimizer state, and its update's temporaries,
    :func:`measure_optimizer`)."""

    block: BlockMemory
    head: HeadMemory
    optimizer_state: int
    optimizer_update: int


def measure_step(config: TrainConfig) -> StepMemory:
    """The :class:`StepMemory` of ``config``."""
    return StepMemory(block_memory(config), measure_head(config), *measure_optimizer(config))
