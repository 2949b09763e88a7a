"""A training step's memory plan, the whole step's: what one block keeps for its backward in each checkpointing mode,
what the final norm, the LM head and its loss hold, the optimizer's state and the temporaries of its update, all
measured for whatever pieces the step runs (:func:`cs336_harness.step_memory.measure_step`); what the wrapper holds
around them (:func:`reserved_bytes`, :func:`head_moments_bytes`); the
step's peak over the moments where it can fall (:func:`expected_peak_bytes`); the memory cap that stands for a
leaderboard rank (:func:`default_memory_cap_bytes`) and the checkpointing they choose (:func:`memory_plan`).

What the pieces hold is counted, not modelled (:mod:`cs336_harness.step_memory`, on fake tensors with the step's
kernels, loss and optimizer); where Inductor decides what is saved (compiled blocks, compiled glue) a byte model
stands in, which the GPU's peaks check. For our FSDP the plan is
the step's peak counted on fake tensors
(:func:`~cs336_harness.studies.leaderboard.memory_trace.traced_peak`) to the byte; for FSDP2 an estimate; the other
wrappers have none. It imports the config (:mod:`cs336_harness.train_config`), never the composition that uses it
(:mod:`cs336_harness.training`).

``checkpoint="budget"`` is the policy that recomputes least within the cap (``memory_cap_gib``, default
:func:`default_memory_cap_bytes` on a GPU): :func:`cs336_sharding.checkpointing.policy_for_budget` over the blocks'
activations, with :func:`reserved_bytes` set aside and what all blocks keep bounded by the loss's moment; the plan
says which policy that was and the peak it expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from cs336_basics.config import ModelConfig
from cs336_sharding.checkpointing import (
    CheckpointPolicySpec,
    backward_bytes,
    kept_bytes,
    parse_policy,
    plan_segments,
    policy_for_budget,
    recomputes_earlier_blocks,
)

from cs336_harness.device import GIB
from cs336_harness.registry import BUDGET, CHUNK_TOKENS
from cs336_harness.step_memory import HeadMemory, StepMemory, measure_step
from cs336_harness.train_config import TrainConfig

# The leaderboard's run, whose ranks a memory cap stands for: the 8B model at its vocabulary and context on two ranks.
LEADERBOARD_MODEL = ModelConfig.from_preset("8B", vocab_size=151_936, context_length=32_768)
LEADERBOARD_WORLD_SIZE = 2
# Bytes of state per parameter of a leaderboard rank: fp32 weight, gradient and AdamW's two moments.
STATE_BYTES_PER_PARAM = 16
# What a device's memory holds besides the tensors the plan counts: the CUDA context, NCCL's buffers, the caching
# allocator's fragmentation. A budget is planned within the rest.
DEVICE_RESERVE_BYTES = 4 * GIB
def default_memory_cap_bytes(config: TrainConfig, device_bytes: int) -> float:
    """The memory a run may use to stand for a leaderboard rank on a device of ``device_bytes``: its own state plus
    the share of a rank's activation memory that its layers would have there,

        cap = state(run) + (device_bytes - reserve - state(leaderboard rank)) * num_layers / 34,
        state = 16 bytes * parameters / world_size   (fp32 weights, gradients, AdamW's two moments)

    with :data:`DEVICE_RESERVE_BYTES` (4 GiB) left to what is not a tensor (on an H200, 92.0 GiB for the 14-layer
    proxy; ``device_bytes`` less the reserve for the leaderboard run)."""
    full = LEADERBOARD_MODEL
    own = STATE_BYTES_PER_PARAM * config.model.num_params / config.parallelism.world_size
    rank_state = STATE_BYTES_PER_PARAM * full.num_params / LEADERBOARD_WORLD_SIZE
    usable = device_bytes - DEVICE_RESERVE_BYTES
    return own + (usable - rank_state) * config.model.num_layers / full.num_layers


def _block_params(model: ModelConfig) -> int:
    """Parameters of one block: all but the embeddings, the head and the final norm, over the blocks."""
    return (model.num_params - 2 * model.vocab_size * model.d_model - model.d_model) // model.num_layers


def _block_weights(model: ModelConfig) -> int:
    """The elements of one block's 2-D weights: what an FSDP gathers and reduce-scatters (its two norms' weights
    are replicated)."""
    return _block_params(model) - 2 * model.d_model


def _held_through_step(config: TrainConfig, step: StepMemory) -> float:
    """What every moment of the backward holds (:func:`reserved_bytes`' first and third items): this rank's fp32
    weights and optimizer state, RoPE's tables, the batch's token ids and targets (int64) and the embedding's
    output."""
    m, e = config.model, config.compute_dtype.itemsize
    tokens = config.batch_per_rank * m.context_length
    return (4 * m.num_params / config.parallelism.world_size + step.optimizer_state
            + 4 * m.context_length * m.head_dim + 2 * 8 * tokens + e * tokens * m.d_model)


# The loss and the gradient the backward starts from (fp32 scalars), alive through the backward; the loss also
# through the optimizer's update.
_LOSS_BYTES = 4


def _after_head_bytes(config: TrainConfig) -> float:
    """What the backward holds from the final norm's backward on, besides the wrapper's buffers: the final norm's
    weight gradient (fp32, d) and the loss and its gradient."""
    return 4 * config.model.d_model + 2 * _LOSS_BYTES


def _head_gradient_bytes(config: TrainConfig) -> float:
    """Our FSDP: the head's fp32 weight gradient in its reduce-scatter buffer, and with several ranks the collective's
    output shard too (in flight until the next unit's gradients are reduced)."""
    m, w = config.model, config.parallelism.world_size
    return 4 * m.vocab_size * m.d_model * (1 + (1 / w if w > 1 else 0))


def reserved_bytes(config: TrainConfig, step: StepMemory) -> float:
    """What the step holds in the last block's backward besides the blocks' activations
    (:func:`~cs336_sharding.checkpointing.backward_bytes`). With P parameters (P_b in one block, G_b of them in
    its 2-D weights, what FSDP gathers), N tokens,
    d = d_model, V = vocab, e = the compute dtype's bytes and W ranks:

    - this rank's fp32 weights, 4 P / W bytes, and its optimizer state (``step``'s; AdamW's two moments are 8 P / W):
      the last step's gradients were freed, and the new ones grow while the backward frees activations;
    - FSDP's gathered weights of two blocks, the one in its backward and the next, prefetched: 2 e G_b;
    - RoPE's cos and sin tables (fp32, context x head_dim / 2 each), the token ids and targets (16 N) and the
      embedding's output (the first block's input), e N d;
    - the final norm's weight gradient (fp32, 4 d), the loss and the gradient the backward started from;
    - our FSDP: the LM head's weight gradient in fp32, FSDP's buffer for its reduce-scatter (4 V d), and with W > 1
      that collective's output shard (4 V d / W). The loss's tensors and its gradients for the head were freed
      before the blocks' backward began (:func:`head_moments_bytes` has them);
    - FSDP2 with the chunked loss (the baselines; not traced): an estimate, the embedding's and head's gathered
      weights and the head's weight gradient in the compute dtype, 3 e V d (FSDP2 makes the root's fp32 gradients in
      its reduce-scatter after the embedding's backward, when the activations are freed); the final norm's saved
      tensors and the head's gradient for the hidden states, (e + 8) N d; one chunk of 4096 tokens of the loss
      recomputed in the backward with its fp32 copy and that copy's gradient, (e + 4 + 4) * 4096 * V. On one H200
      this is 0.95 GiB over the allocator's peak of the strong recipe at the proxy shape, with 7 and with 8 blocks
      checkpointed.
    """
    m, e = config.model, config.compute_dtype.itemsize
    n, d, v = config.batch_per_rank * m.context_length, m.d_model, m.vocab_size
    common = _held_through_step(config, step) + _after_head_bytes(config) + 2 * e * _block_weights(m)
    if config.parallelism.wrapper == "fsdp":
        return common + _head_gradient_bytes(config)
    return common + 3 * e * v * d + (e + 8) * n * d + (e + 4 + 4) * min(CHUNK_TOKENS, n) * v


def head_moments_bytes(config: TrainConfig, head: HeadMemory) -> float:
    """The step's peak at its end, above what it holds there besides (its state, :func:`_held_through_step`, and what
    every block keeps): the largest of the loss's moments (:class:`~cs336_harness.step_memory.HeadMemory`, measured)
    with the wrapper's weights and buffers around them (e = the compute dtype's bytes, G_b elements in one block's 2-D
    weights, V = vocab, d = d_model):

    - the forward of the final norm and the loss, with the head's gathered weights (e V d; our FSDP gathers them
      while the last block runs, FSDP2's root holds them with the embedding's, 2 e V d, through the step);
    - the loss's backward: the head's weights gathered again and the last block's, prefetched (e G_b);
    - our FSDP: the head's reduce-scatter, its weights freed and its fp32 gradient buffer made
      (:func:`_head_gradient_bytes`) while the gradients the loss handed back are alive; then the final norm's
      backward beside that buffer. FSDP2 keeps the head's weight gradient (e V d) through the final norm's backward.
    """
    m, e = config.model, config.compute_dtype.itemsize
    gathered = e * m.vocab_size * m.d_model
    block = e * _block_weights(m)
    if config.parallelism.wrapper == "fsdp":
        buffer = _head_gradient_bytes(config)
        return max(gathered + head.forward, gathered + block + head.backward, block + head.handed + buffer,
                   block + buffer + head.norm)
    return max(2 * gathered + head.forward, 2 * gathered + block + max(head.backward, gathered + head.norm))


def _freed_input_bytes(config: TrainConfig, step: StepMemory, policy: CheckpointPolicySpec) -> float:
    """The embedding's output (the first block's input, e N d), which every moment of the backward holds
    (:func:`_held_through_step`), where no one keeps it: a first block run plainly that does not keep its input."""
    m = config.model
    first = plan_segments(m.num_layers, policy)[0]
    if isinstance(first, int) and not step.block.saves_input:
        return config.compute_dtype.itemsize * config.batch_per_rank * m.context_length * m.d_model
    return 0


def expected_peak_bytes(config: TrainConfig, step: StepMemory, policy: CheckpointPolicySpec) -> float:
    """The step's peak under ``policy``, its blocks, loss and optimizer as ``step`` counted them: the largest of
    :func:`reserved_bytes` plus the blocks' share in the last block's backward
    (:func:`~cs336_sharding.checkpointing.backward_bytes`; for FSDP2 the largest block's); what the step holds at
    its end (its state and what every block keeps, :func:`~cs336_sharding.checkpointing.kept_bytes`) plus
    :func:`head_moments_bytes`; the optimizer's update (this rank's weights, gradients and state, 16 P / W, and its
    temporaries); and with our FSDP the other blocks' backwards and the embedding's (P parameters, P_b in one block,
    G_b in its 2-D weights, N tokens, L blocks, d = d_model, V = vocab, e = the compute dtype's bytes, W ranks; what
    every step holds, as in :func:`reserved_bytes`, aside):

    - each earlier block's backward: its activations and what the other blocks hold then
      (:func:`~cs336_sharding.checkpointing.backward_bytes`: with segments of several blocks, the segment's
      recomputed blocks), the fp32 gradients of every later block and of the head (4 (L - 1 - i) P_b + 4 V d for
      block i, over W ranks plus the reduce-scatter in flight, 4 G_b, with W > 1), its gathered weights and the
      next one's, prefetched (2 e G_b; for the first block the embedding's, e G_b + e V d). A backward that begins
      by recomputing earlier blocks (:func:`~cs336_sharding.checkpointing.recomputes_earlier_blocks`), the last
      block's too, holds its own weights alone: the one prefetched is the first block recomputed, which FSDP frees
      after its forward;
    - the embedding's backward, last: every block's and the head's fp32 gradients, the embedding's gathered weights,
      its dense weight gradient (zeros, then the scatter-add's result: 2 e V d) and the gradient reaching it.

    A block's output (e N d) that no one keeps is not counted where it is freed (``kept_bytes`` and
    ``backward_bytes`` leave out the output of a block before one that is run plainly and does not keep its input,
    :attr:`~cs336_sharding.checkpointing.BlockMemory.saves_input`; :func:`_freed_input_bytes` the embedding's;
    the final norm likewise for the last block's).

    Exact for our FSDP, whatever the loss, the glue and the checkpointing (segments of several blocks and nested
    ones too; :func:`~cs336_harness.studies.leaderboard.memory_trace.traced_peak` counts the step's tensors; on one
    H200 that count is within 0.1 GiB of the allocator's peak: cuBLAS' workspace and rounding); the two-rank terms
    come from FSDP's code, not a trace. For FSDP2 an estimate, whose reserve does not follow the gradients through
    the backward: the blocks' largest share beside it.
    """
    m = config.model
    block = step.block
    e = config.compute_dtype.itemsize
    output = e * config.batch_per_rank * m.context_length * m.d_model
    freed = _freed_input_bytes(config, step, policy)
    held = _held_through_step(config, step)
    blocks = backward_bytes(block, m.num_layers, policy)
    kept = sum(kept_bytes(block, m.num_layers, policy)) - freed - (not step.head.saves_input) * output
    end = held + kept + head_moments_bytes(config, step.head)
    update = held - output + 4 * m.num_params / config.parallelism.world_size + _LOSS_BYTES + step.optimizer_update
    if config.parallelism.wrapper != "fsdp":
        return max(reserved_bytes(config, step) + max(blocks) - freed, end, update)
    d, v, w, layers = m.d_model, m.vocab_size, config.parallelism.world_size, m.num_layers
    block_params, block_weights = _block_params(m), _block_weights(m)
    # FSDP prefetches the next unit its backward order uses: where a block's backward begins by recomputing earlier
    # blocks, the first of those, freed after its forward (its own backward has not begun).
    alone = [e * block_weights if again else 0 for again in recomputes_earlier_blocks(layers, policy)]
    last = reserved_bytes(config, step) + blocks[-1] - freed - alone[-1]
    in_flight = 4 * block_weights if w > 1 else 0
    before = held + _after_head_bytes(config) - freed
    # Block i's backward, for every block but the last (for a single block, its backward as the first's too).
    earlier = [before + blocks[i] + 4 * ((layers - 1 - i) * block_params + v * d) / w + in_flight - alone[i]
               + e * block_weights + (e * v * d if i == 0 else e * block_weights) for i in range(max(layers - 1, 1))]
    embedding = held + _after_head_bytes(config) + 4 * (layers * block_params + v * d) / w + in_flight + 3 * e * v * d
    return max(last, end, *earlier, embedding, update)


# The wrappers the plan covers: the FSDPs, ours counted to the byte and FSDP2 estimated.
PLANNED_WRAPPERS: tuple[str, ...] = ("fsdp", "fsdp2")


@dataclass(frozen=True)
class MemoryPlan:
    """The checkpointing a run uses and the memory it expects: ``cap_bytes`` (None without one), ``step`` (what its
    blocks, loss and optimizer hold, :func:`~cs336_harness.step_memory.measure_step`), ``policy`` and
    ``expected_peak_bytes`` (:func:`expected_peak_bytes`, for every checkpointing policy; None for a wrapper it does
    not cover, :data:`PLANNED_WRAPPERS`)."""

    cap_bytes: float | None
    step: StepMemory
    policy: CheckpointPolicySpec
    expected_peak_bytes: float | None


def memory_plan(config: TrainConfig, device_bytes: int | None) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``config`` on a device of ``device_bytes`` (None on CPU).

    Raises:
        ValueError: for ``budget`` under a wrapper the plan does not cover (:data:`PLANNED_WRAPPERS`), without a cap
            (``memory_cap_gib``, or a device to take the default from), or with one below the step's peak with every
            block checkpointed.
    """
    par = config.parallelism
    if par.checkpoint == BUDGET and par.wrapper not in PLANNED_WRAPPERS:
        raise ValueError(f"checkpoint 'budget' plans the steps of wrapper {' or '.join(PLANNED_WRAPPERS)}, got "
                         f"{par.wrapper!r}; name a checkpoint policy")
    if par.memory_cap_gib is not None:
        cap = par.memory_cap_gib * GIB
    else:
        cap = None if device_bytes is None else default_memory_cap_bytes(config, device_bytes)
    step = measure_step(config)
    if par.checkpoint == BUDGET:
        if cap is None:
            raise ValueError("checkpoint 'budget' needs memory_cap_gib without a GPU (its default comes from the GPU's "
                             "memory)")
        least = expected_peak_bytes(config, step, CheckpointPolicySpec("all"))
        if cap < least:
            raise ValueError(f"the memory cap, {cap / GIB:.3g} GiB, is below the step's peak with every block "
                             f"checkpointed ({least / GIB:.3g} GiB: this rank's weights, gradients and optimizer "
                             "state, the gathered weights and gradient buffers, the loss's tensors); raise "
                             "memory_cap_gib (--memory-cap-gib) to that or more")
        # The policy decides the last block's backward, the peak whenever a block is kept, and the end of the step,
        # where every block's activations meet the loss's; the other moments do not depend on it, and fit.
        kept_cap = cap - _held_through_step(config, step) - head_moments_bytes(config, step.head)
        policy = policy_for_budget(step.block, config.model.num_layers, cap - reserved_bytes(config, step),
                                   keep_attention=par.budget_keeps_attention, kept_budget_bytes=kept_cap)
    else:
        policy = parse_policy(par.checkpoint)
    expected = expected_peak_bytes(config, step, policy) if par.wrapper in PLANNED_WRAPPERS else None
    return MemoryPlan(cap, step, policy, expected)


def device_memory_bytes(device: torch.device) -> int | None:
    """The memory of ``device``, a CUDA GPU's; None for any other device."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
