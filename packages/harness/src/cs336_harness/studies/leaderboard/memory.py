"""A leaderboard run's memory plan: what one ``cs336_basics`` block keeps for its backward with the run's kernels
(:func:`block_memory`), what the step holds besides (:func:`reserved_bytes`), the memory cap that stands for a
leaderboard rank (:func:`default_memory_cap_bytes`) and the checkpointing they choose (:func:`memory_plan`).

``checkpoint="budget"`` is the policy that recomputes least within the cap (``memory_cap_gib``, default
:func:`default_memory_cap_bytes` on a GPU): :func:`cs336_sharding.checkpointing.policy_for_budget` over the blocks'
activations, with :func:`reserved_bytes` set aside; the plan says which policy that was and the peak it expects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cs336_sharding.checkpointing import (
    BlockMemory,
    CheckpointPolicySpec,
    activation_peak_bytes,
    kept_bytes,
    parse_policy,
    policy_for_budget,
)

from cs336_harness.device import DTYPES, GIB
from cs336_harness.studies.glue import GLUES
from cs336_harness.studies.leaderboard.baselines import CHUNK_TOKENS
from cs336_harness.studies.leaderboard.config import (
    BUDGET,
    LEADERBOARD_DEFAULTS,
    LeaderboardConfig,
    leaderboard_model_config,
)

# Bytes of state per parameter through the step: fp32 weight, gradient and AdamW's two moments; the weight and the
# moments alone are what lives at the start of the backward (the gradients of the previous step were freed).
STATE_BYTES_PER_PARAM = 16
STATE_AT_BACKWARD_BYTES_PER_PARAM = 12
# What a device's memory holds besides the tensors the plan counts: the CUDA context, NCCL's buffers, the caching
# allocator's fragmentation. A budget is planned within the rest.
DEVICE_RESERVE_BYTES = 4 * GIB


def default_memory_cap_bytes(config: LeaderboardConfig, device_bytes: int) -> float:
    """The memory a run may use to stand for a leaderboard rank on a device of ``device_bytes``: its own state plus
    the share of a rank's activation memory that its layers would have there,

        cap = state(run) + (device_bytes - reserve - state(leaderboard rank)) * num_layers / 34,
        state = 16 bytes * parameters / world_size   (fp32 weights, gradients, AdamW's two moments)

    with :data:`DEVICE_RESERVE_BYTES` (4 GiB) left to what is not a tensor (on an H200, 92.0 GiB for the 14-layer
    proxy; ``device_bytes`` less the reserve for the leaderboard run)."""
    full = leaderboard_model_config()
    own = STATE_BYTES_PER_PARAM * config.model_config.num_params / config.world_size
    rank_state = STATE_BYTES_PER_PARAM * full.num_params / LEADERBOARD_DEFAULTS["world_size"]
    usable = device_bytes - DEVICE_RESERVE_BYTES
    return own + (usable - rank_state) * config.model_config.num_layers / full.num_layers


def expected_peak_bytes(config: LeaderboardConfig, block: BlockMemory, policy: CheckpointPolicySpec) -> float:
    """The step's peak under ``policy`` with blocks that keep ``block``: :func:`reserved_bytes` plus the blocks'
    share in the last block's backward (:func:`~cs336_sharding.checkpointing.activation_peak_bytes`), and for ours
    the largest of that and three other moments (P parameters, P_b in one block, N tokens, L blocks, d = d_model,
    V = vocab, e = the compute dtype's bytes, W ranks; what every step holds, as in :func:`reserved_bytes`, aside):

    - the first block's backward: its activations and working set, the fp32 gradients of every later block and of
      the head (4 (L - 1) P_b + 4 V d, over W ranks plus the reduce-scatter in flight, 4 P_b, with W > 1), its
      gathered weights and the embedding's, prefetched (e P_b + e V d). Between the first and the last block the
      peak falls then rises (checkpointed blocks free more gradients' worth than they keep, kept blocks less), so
      these two moments bound every block's;
    - the fused loss at the end of the forward: what every block keeps, the final norm's output, the head's gathered
      weights, the loss's gradients for the hidden states and the head (e N d + e V d), one chunk of logits;
    - the embedding's backward, last: every block's and the head's fp32 gradients, the embedding's gathered weights,
      its dense weight gradient (zeros, then the scatter-add's result: 2 e V d) and the gradient reaching it.

    Exact for ours with the Triton glue (:func:`~cs336_harness.studies.leaderboard.memory_trace.traced_peak` counts
    the step's tensors; on one H200 that count is within 0.1 GiB of the allocator's peak: cuBLAS' workspace and
    rounding); the two-rank terms come from FSDP's code, not a trace.
    """
    # Imported here: on CPU the Triton interpreter must be chosen before the kernels load.
    from cs336_kernels import CHUNK_BYTES

    last = reserved_bytes(config) + activation_peak_bytes(block, config.model_config.num_layers, policy)
    if config.impl != "ours":
        return last
    m = config.model_config
    e = DTYPES[config.compute_dtype].itemsize
    n, d, v, w, layers = config.batch_per_rank * config.context_length, m.d_model, m.vocab_size, config.world_size, \
        m.num_layers
    block_params = _block_params(config)
    common = _held_through_step(config)
    in_flight = 4 * block_params if w > 1 else 0
    grads = 4 * ((layers - 1) * block_params + v * d) / w + in_flight
    first = common + block.kept + block.working + grads + e * block_params + e * v * d
    head = (common + sum(kept_bytes(block, layers, policy)) + e * n * d + 2 * e * v * d + e * n * d
            + min(CHUNK_BYTES, n * v * e))
    embedding = common + 4 * (layers * block_params + v * d) / w + in_flight + 3 * e * v * d
    return max(last, first, head, embedding)


def _block_params(config: LeaderboardConfig) -> int:
    """Parameters of one block: all but the embeddings, the head and the final norm, over the blocks."""
    m = config.model_config
    return (m.num_params - 2 * m.vocab_size * m.d_model - m.d_model) // m.num_layers


def _held_through_step(config: LeaderboardConfig) -> float:
    """What every moment of the backward holds (:func:`reserved_bytes`' first and third items): this rank's weights
    and AdamW moments, RoPE's tables and the embedding's output."""
    m = config.model_config
    e = DTYPES[config.compute_dtype].itemsize
    return (STATE_AT_BACKWARD_BYTES_PER_PARAM * m.num_params / config.world_size
            + 4 * config.context_length * m.head_dim + e * config.batch_per_rank * config.context_length * m.d_model)


def _head_gradient_bytes(config: LeaderboardConfig) -> float:
    """Ours: the head's fp32 weight gradient in FSDP's reduce-scatter buffer, and with several ranks the collective's
    output shard too (in flight until the next unit's gradients are reduced)."""
    m, w = config.model_config, config.world_size
    return 4 * m.vocab_size * m.d_model * (1 + (1 / w if w > 1 else 0))


def reserved_bytes(config: LeaderboardConfig) -> float:
    """What the step holds in the last block's backward besides the blocks' activations
    (:func:`~cs336_sharding.checkpointing.activation_peak_bytes`). With P parameters (P_b in one block), N tokens,
    d = d_model, V = vocab, e = the compute dtype's bytes and W ranks:

    - weights and AdamW moments of this rank's shard, 12 P / W bytes (the last step's gradients were freed; the
      new ones grow while the backward frees activations);
    - FSDP's gathered weights of two blocks, the one in its backward and the next, prefetched: 2 e P_b;
    - RoPE's cos and sin tables (fp32, context x head_dim / 2 each) and the embedding's output (the first block's
      input), e N d;
    - ours: the LM head's weight gradient in fp32, FSDP's buffer for its reduce-scatter (4 V d), and with W > 1
      that collective's output shard (4 V d / W). The fused loss's chunk of logits and its gradients for the head
      were freed before the blocks' backward began;
    - the baselines (FSDP2, not traced): an estimate, the embedding's and head's gathered weights and the head's
      weight gradient in the compute dtype, 3 e V d (FSDP2 makes the root's fp32 gradients in its reduce-scatter
      after the embedding's backward, when the activations are freed); the final norm's saved tensors and the head's
      gradient for the hidden states, (e + 8) N d; one chunk of 4096 tokens of the loss recomputed in the backward
      with its fp32 copy and that copy's gradient, (e + 4 + 4) * 4096 * V. On one H200 this is 0.95 GiB over the
      allocator's peak of the strong recipe at the proxy shape, with 7 and with 8 blocks checkpointed.
    """
    m = config.model_config
    e = DTYPES[config.compute_dtype].itemsize
    n, d, v = config.batch_per_rank * config.context_length, m.d_model, m.vocab_size
    common = _held_through_step(config) + 2 * e * _block_params(config)
    if config.impl == "ours":
        return common + _head_gradient_bytes(config)
    return common + 3 * e * v * d + (e + 8) * n * d + (e + 4 + 4) * min(CHUNK_TOKENS, n) * v


class BlockShape(Protocol):
    """The dimensions :func:`block_memory` needs (a ``cs336_basics.config.ModelConfig`` has them)."""

    d_model: int
    d_ff: int
    num_heads: int


def block_memory(shape: BlockShape, batch: int, seq: int, *, dtype_bytes: int = 2, glue: str = "model",
                 fused_qkv: bool = False, attention: str = "triton") -> BlockMemory:
    """:class:`~cs336_sharding.checkpointing.BlockMemory` of one ``cs336_basics`` block (RMSNorm, RoPE attention
    with a fused attention op, RMSNorm, SwiGLU) on ``batch`` sequences of ``seq`` tokens with 16-bit
    (``dtype_bytes=2``) or fp32 compute, its glue ``glue`` (:data:`~cs336_harness.studies.glue.GLUES`) and
    ``attention`` (``"triton"``, our kernels, or ``"sdpa"``), its weights gathered by FSDP (views whose memory is freed
    after the forward, so they count nothing).

    With N = batch * seq tokens, d = d_model, f = d_ff, h = heads, e = dtype_bytes, what autograd keeps:

    - both norms: ``glue="model"`` upcasts x and keeps it and ``x * rstd`` in fp32 (8 N d; the first norm's
      upcast of an fp32 block input is the input itself) and rstd (4 N); the kernels keep their input (the block
      input for the first, free here; the residual sum h for the second, which the residual add folded into it
      writes and keeps: e N d) and rstd (4 N);
    - the q / k / v projections keep the normed input (e N d); RoPE keeps its tables' rows (the model's own:
      cos and sin gathered at the positions for q and for k, 4 * 4 * seq * d / (2 h)) or the positions (the
      kernel: 8 seq, int64); the attention op keeps rotated q and k, v and its output (4 e N d) and the fp32
      log-sum-exp (4 N h); with ``fused_qkv`` v is a view of the (N, 3 d) projection output, which it keeps
      whole (2 e N d more), and the matmul keeps the concatenated (3 d, d) weight (3 e d^2);
    - the output projection keeps the heads' outputs in (N, d) layout: with our kernels a view of the attention
      output, which they write in the layout of their q, the projections' (batch, seq, heads, head_dim) under our
      RoPE; a copy (e N d) where the output is (batch, heads, seq, head_dim)-contiguous: SDPA's (on the CPU, where
      the tests check it), and ours after the model's RoPE, which returns q heads-first contiguous;
    - SwiGLU: w1 and w3 keep the normed input (e N d); the gate keeps a = w1 x, sigmoid(a), a * sigmoid(a) and
      b = w3 x (4 e N f) in the model's code, a and b (2 e N f) in the kernel; w2 keeps the gate's output (e N f);
    - the block's output (e N d).

    ``attention`` is the output plus the attention op's output and log-sum-exp; ``selective`` adds the outputs of
    the matmuls the recomputation uses (q, k, v, the output projection's, w1's and w3's: 4 e N d + 2 e N f; not
    w2's, :mod:`cs336_sharding.checkpointing`), whatever the glue, which is recomputed; ``checkpointed`` is the
    output.
    ``working``, with the kernels: the backward's peak is in the gate's backward, holding w2's weight gradient
    (e d f) and the gate's two input gradients (2 e N f); the gradient that reached the block's output and the
    gradient of the gate's output take the place of the block's output and the gate's output, freed by then.
    With the model's glue its fp32 norm backwards peak elsewhere: counted as one more block's activations,
    ``kept``, an upper bound (6 GiB over the traced peak of the 14-layer proxy).
    ``glue="compiled"`` (torch.compile of the kernels' PyTorch references) is counted as the kernels.
    """
    if glue not in GLUES:
        raise ValueError(f"glue must be one of {', '.join(GLUES)}, got {glue!r}")
    if attention not in ("triton", "sdpa"):
        raise ValueError(f"attention must be 'triton' or 'sdpa', got {attention!r}")
    for name, value in (("batch", batch), ("seq", seq), ("dtype_bytes", dtype_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    d, f, h = shape.d_model, shape.d_ff, shape.num_heads
    n, e = batch * seq, dtype_bytes
    out, lse = e * n * d, 4 * n * h
    if glue == "model":
        upcast = 4 * n * d if e < 4 else 0  # the first norm's fp32 copy of the block input (fp32: the input itself)
        norms = upcast + 3 * 4 * n * d + 2 * 4 * n
        rope = 4 * 4 * seq * (d // h // 2)
        gate = 4 * e * n * f
    else:
        norms = e * n * d + 2 * 4 * n
        rope = 8 * seq
        gate = 2 * e * n * f
    # input, q k v o, SDPA's (N, d) copy; fused: q and k stay alive in the (N, 3d) output, and the (3d, d) weight
    copy = e * n * d if attention == "sdpa" or glue == "model" else 0
    attention = (1 + 4) * e * n * d + copy + lse + ((2 * n + 3 * d) * e * d if fused_qkv else 0)
    ffn = e * n * d + gate + e * n * f
    kept = norms + rope + attention + ffn + out
    working = kept if glue == "model" else e * d * f + 2 * e * n * f
    attention_kept = out + e * n * d + lse
    selective = attention_kept + 4 * e * n * d + 2 * e * n * f
    return BlockMemory(kept=kept, selective=selective, attention=attention_kept, checkpointed=out, working=working)


@dataclass(frozen=True)
class MemoryPlan:
    """The checkpointing a run uses and the memory it expects: ``cap_bytes`` (None without one), ``block`` (what a
    block keeps, :func:`block_memory`), ``policy`` and ``expected_peak_bytes``
    (:func:`expected_peak_bytes`; None for a policy it does not cover)."""

    cap_bytes: float | None
    block: BlockMemory
    policy: CheckpointPolicySpec
    expected_peak_bytes: float | None


def memory_plan(config: LeaderboardConfig, device_bytes: int | None) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``config`` on a device of ``device_bytes`` (None on CPU). A compiled block is
    counted as the compiled glue (``glue="compiled"``): Inductor's partitioner keeps the inputs of the norms and of
    the gate and recomputes the rest, as it does for the compiled glue alone."""
    m = config.model_config
    if config.memory_cap_gib is not None:
        cap = config.memory_cap_gib * GIB
    else:
        cap = None if device_bytes is None else default_memory_cap_bytes(config, device_bytes)
    block = block_memory(m, config.batch_per_rank, config.context_length,
                         dtype_bytes=DTYPES[config.compute_dtype].itemsize,
                         glue="compiled" if config.compile_blocks else config.glue,
                         fused_qkv=config.fused_qkv, attention=config.attention)
    if config.checkpoint == BUDGET:
        assert cap is not None, "LeaderboardConfig checks that a budget has a cap"
        # The policy decides the last block's backward, the peak whenever a block is kept; the first block's does
        # not depend on it.
        policy = policy_for_budget(block, m.num_layers, cap - reserved_bytes(config),
                                   keep_attention=config.impl == "ours")
    else:
        policy = parse_policy(config.checkpoint)
    try:
        expected = expected_peak_bytes(config, block, policy)
    except ValueError:
        expected = None
    return MemoryPlan(cap, block, policy, expected)
