"""Activation checkpointing of a model's blocks, applied in place from outside the model.

The forward of a checkpointed segment keeps only the segment's input, and the backward re-runs the segment to
get its saved tensors back (Chen et al., 2016, "Training deep nets with sublinear memory cost"), with
``torch.utils.checkpoint.checkpoint`` (non-reentrant). :func:`apply_checkpointing` replaces the model's
``layers`` (an ``nn.ModuleList`` of blocks run in order by its ``forward``, as ``BasicsTransformerLM`` has) by a
:class:`CheckpointedBlocks` holding the very same blocks at the same indices, so parameter names stay
``layers.N.…`` and FSDP (:mod:`cs336_sharding.fsdp`) composes in either order: its hooks sit on the blocks, which
are still called as modules (on the recomputation too). Compiled blocks (:meth:`CheckpointedBlocks.compile_blocks`,
after checkpointing) have a block checkpointed on its own compiled with its checkpoint, which Inductor then applies:
the hooks run once, around the compiled forward, and the compiled backward does the recomputation.

Policies (strings, as given to ``cs336 bench --checkpoint``):

- ``none``: leave the model alone.
- ``all``: each block its own segment (``group:1``).
- ``group:K``: consecutive segments of K blocks (the last may be shorter). Peak activation memory is
  about ``N/K`` segment inputs plus ``K`` blocks' saved tensors during one segment's backward.
- ``first:N``: checkpoint only the first N blocks, one each; the rest keep what they save. ``first:N+selective:M``:
  then the next M blocks ``selective``, the rest not checkpointed.
- ``sqrt``: ``group:ceil(sqrt(num_layers))``, the single-level choice that balances the two terms
  when a segment input costs about as much as one block's saved tensors.
- ``nested:B``: recursive segments, each split into B sub-segments down to single blocks; with B=2,
  peak memory is O(log N) segment inputs plus one block's saved tensors, at O(N log N) block forwards.
- ``selective``: each block its own segment, but matmul outputs (and fused attention outputs) are
  saved, so the backward recomputes only the cheap elementwise and normalisation ops. Not the output of the
  matmul whose weight operand has the shape :attr:`SavedOps.skipped_operand` (a feed-forward's down projection:
  it feeds only the residual add, which saves nothing, and the recomputation stops (checkpoint's early stop) once
  that matmul has saved its input, before it would run). ``selective:N``: the first N blocks so, the rest not
  checkpointed.
- ``attention``: each block its own segment, saving only the outputs of the fused attention operators the caller
  names (:attr:`SavedOps.attention`: SDPA's kernels, a FlashAttention kernel's registered forward; output and
  log-sum-exp, about ``b * T * d_model`` elements per block), so the backward's recomputation skips the one op whose
  cost grows as ``T^2``; the matmuls are recomputed. An unfused attention (its scores by matmuls) has no such op:
  the policy then keeps nothing of it. ``attention:N``: the first N blocks so, the rest not checkpointed;
  ``attention:N+selective:M``: then the next M blocks ``selective``, the rest not checkpointed.
- ``offload``: no block checkpointed, but what each block saves for its backward is copied to pinned host memory in
  its forward and back in the backward of the block after it (:mod:`cs336_sharding.offload`), where the transfers
  hide under compute; it recomputes nothing. ``offload:N``: the first N blocks so (their backward comes last, once
  the later blocks have freed theirs); ``offload:N+selective:M``: then the next M blocks ``selective``, the rest
  not checkpointed.

Sized from a memory budget: :func:`policy_for_budget` picks the policy that recomputes least within a budget for
activations, from what one block keeps in each mode (:class:`BlockMemory`, measured by whoever knows the block and
its kernels, as ``cs336_harness``'s memory plan does by tracing one block on fake tensors).
Memory per block is ``kept > selective > attention > checkpointed``, and so is the time it saves: keeping a block's
attention outputs costs ``b * T * d_model`` elements and saves the attention forward, keeping its matmul outputs too
(``selective``) saves every matmul of the recomputation, which leaves its memory-bound norms and elementwise ops,
and keeping the whole block saves its whole forward. So the rule is greedy in that order of cost: as few blocks
recomputing their matmuls as fit, then as few recomputing anything. Without the ``attention`` tier (a checkpointed
block keeps its matmuls' and attention's outputs or nothing: torchtitan's full and op-level selective checkpointing)
the same rule picks ``selective:M``, then ``first:N+selective:M``. The blocks kept whole are the *last* ones: their
backward runs first, so their activations are freed before any checkpointed block is recomputed, and the
blocks' share of the peak, reached in the last block's backward, is ``what every block but the last keeps + the
last block's activations + its backward's working set`` (the last block's activations are all there: kept, or
recomputed). Segments of several blocks (``group:K``, ``sqrt``, ``nested:B``) are not among the budget's choices;
:func:`backward_bytes` counts them too, by how their recomputation runs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from cs336_sharding.offload import BlockOffload

POLICY_KINDS: tuple[str, ...] = ("none", "all", "group", "first", "sqrt", "nested", "selective", "attention",
                                 "offload")
# Policies after which ``+selective:M`` may follow.
_COMBINES = ("first", "attention", "offload")
# Group sizes tried by ``cs336 bench --checkpoint groups`` (those up to the model's depth).
GROUP_SWEEP: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 16, 32)
_NEEDS_ARG = {"group", "first"}
_TAKES_ARG = {"group", "first", "nested", "attention", "selective", "offload"}


@dataclass(frozen=True)
class CheckpointPolicySpec:
    """A parsed policy: ``kind`` from :data:`POLICY_KINDS`, its integer argument, if any, and for ``first:N``,
    ``attention:N`` and ``offload:N`` the number of ``selective`` blocks after the first N (``first:N+selective:M``)."""

    kind: str
    arg: int | None = None
    selective: int = 0

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"unknown checkpoint policy {self.kind!r}; expected one of {', '.join(POLICY_KINDS)}")
        if self.kind in _NEEDS_ARG and self.arg is None:
            raise ValueError(f"checkpoint policy {self.kind!r} needs a count, e.g. '{self.kind}:4'")
        if self.kind not in _TAKES_ARG and self.arg is not None:
            raise ValueError(f"checkpoint policy {self.kind!r} takes no count, got {self.arg}")
        if self.arg is not None and self.arg < (2 if self.kind == "nested" else 1):
            raise ValueError(f"checkpoint policy {self.kind!r} needs a count >= {2 if self.kind == 'nested' else 1}, "
                             f"got {self.arg}")
        if self.selective and (self.kind not in _COMBINES or self.arg is None or self.selective < 1):
            raise ValueError(f"'+selective:M' follows 'first:N', 'attention:N' or 'offload:N' with M >= 1; got "
                             f"{self.kind}:{self.arg} and {self.selective}")

    def __str__(self) -> str:
        text = self.kind if self.arg is None else f"{self.kind}:{self.arg}"
        return f"{text}+selective:{self.selective}" if self.selective else text

    def per_block(self, num_blocks: int) -> list[str]:
        """What each of ``num_blocks`` blocks is under ``none``, ``all``, ``first``, ``attention``, ``selective`` and
        ``offload`` policies: ``checkpointed``, ``attention`` or ``selective`` (checkpointed, keeping those ops'
        outputs), ``offloaded`` or ``kept``.

        Raises:
            ValueError: for any other kind, or for more blocks named than ``num_blocks``.
        """
        tier = {"all": "checkpointed", "first": "checkpointed", "attention": "attention", "selective": "selective",
                "offload": "offloaded", "none": "kept"}.get(self.kind)
        if tier is None:
            raise ValueError(f"per-block tiers cover none, all, first:N[+selective:M], attention[:N[+selective:M]], "
                             f"offload[:N[+selective:M]] and selective[:N], got {self}")
        if (self.arg or 0) + self.selective > num_blocks:
            raise ValueError(f"checkpoint policy {self} names {(self.arg or 0) + self.selective} blocks, but the "
                             f"model has {num_blocks}")
        first = num_blocks if self.arg is None else min(self.arg, num_blocks)
        then = min(self.selective, num_blocks - first)
        return [tier] * first + ["selective"] * then + ["kept"] * (num_blocks - first - then)


def parse_policy(text: str | CheckpointPolicySpec) -> CheckpointPolicySpec:
    """Parse ``'none'``, ``'all'``, ``'group:4'``, ``'first:8'``, ``'first:2+selective:6'``, ``'sqrt'``,
    ``'nested:2'``, ``'selective'``, ``'selective:4'``, ``'attention'``, ``'attention:2+selective:6'``, ``'offload:4'``,
    ``'offload:2+selective:6'`` (a spec is returned as it is)."""
    if isinstance(text, CheckpointPolicySpec):
        return text
    if not isinstance(text, str):
        raise TypeError(f"a checkpoint policy is a string such as 'group:4', got {type(text).__name__}")
    head, plus, tail = text.strip().partition("+")
    if plus:
        first, then = parse_policy(head), parse_policy(tail)
        if first.kind not in _COMBINES or first.arg is None or then.kind != "selective" or then.arg is None:
            raise ValueError(f"checkpoint policy {text!r}: only 'first:N+selective:M', 'attention:N+selective:M' and "
                             "'offload:N+selective:M' combine two policies")
        return CheckpointPolicySpec(first.kind, first.arg, then.arg)
    kind, sep, count = text.strip().partition(":")
    if not sep:
        return CheckpointPolicySpec(kind, 2 if kind == "nested" else None)
    try:
        arg = int(count)
    except ValueError:
        raise ValueError(f"checkpoint policy {text!r}: expected an integer after ':', got {count!r}") from None
    return CheckpointPolicySpec(kind, arg)


# The matmul operators whose outputs ``selective`` segments keep.
MATMUL_OPS: frozenset[torch._ops.OpOverload] = frozenset(
    {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default})


@dataclass(frozen=True)
class SavedOps:
    """What the segments that keep ops' outputs keep, as the caller who knows the model and its kernels names it:
    ``attention``, the fused attention operators whose outputs the ``attention`` policies keep (``selective`` keeps
    them and the matmuls' outputs); ``skipped_operand``, the (rows, cols) shape of the weight operand of the one
    matmul whose output ``selective`` recomputes instead (None: none)."""

    attention: frozenset[torch._ops.OpOverload] = frozenset()
    skipped_operand: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.attention, frozenset) or not all(
                isinstance(op, torch._ops.OpOverload) for op in self.attention):
            raise TypeError(f"attention must be a frozenset of operator overloads, got {self.attention!r}")
        shape = self.skipped_operand
        if shape is not None and (not isinstance(shape, tuple) or len(shape) != 2
                                  or not all(isinstance(n, int) and n > 0 for n in shape)):
            raise ValueError(f"skipped_operand must be None or a (rows, cols) pair of positive ints, got {shape!r}")

    def kept_by(self, kind: str) -> frozenset[torch._ops.OpOverload]:
        """What a segment that keeps ``kind`` (``attention`` or ``selective``) keeps from the forward."""
        return self.attention | MATMUL_OPS if kind == "selective" else self.attention


# No attention operator named and no matmul skipped: ``attention`` segments keep nothing, ``selective`` every matmul.
NO_SAVED_OPS = SavedOps()


@dataclass(frozen=True)
class Segment:
    """Blocks run inside one checkpoint: indices of blocks, or nested segments (recomputed in turn); ``keeps``
    names the ops whose outputs it keeps (``attention``, ``selective``; ``""`` keeps none)."""

    items: tuple[int | Segment, ...]
    keeps: str = ""

    @property
    def num_blocks(self) -> int:
        return sum(1 if isinstance(i, int) else i.num_blocks for i in self.items)


@dataclass(frozen=True)
class Offloaded:
    """A block run whole, what it saves for its backward offloaded to host memory (``offload`` policies)."""

    index: int


def _nested(indices: list[int], branching: int) -> Segment:
    if len(indices) == 1:
        return Segment((indices[0],))
    size = math.ceil(len(indices) / branching)
    return Segment(tuple(_nested(indices[i : i + size], branching) for i in range(0, len(indices), size)))


def plan_segments(num_blocks: int, policy: str | CheckpointPolicySpec) -> tuple[int | Segment | Offloaded, ...]:
    """What runs at the top level for ``policy``: a block index (run plainly), a :class:`Segment` or an
    :class:`Offloaded` block."""
    spec = parse_policy(policy)
    n = num_blocks
    if spec.kind in ("none", "first", "attention", "selective", "offload"):
        tiers = spec.per_block(n)
        return tuple(i if tier == "kept" else Offloaded(i) if tier == "offloaded"
                     else Segment((i,), "" if tier == "checkpointed" else tier) for i, tier in enumerate(tiers))
    if spec.kind == "nested":
        return (_nested(list(range(n)), spec.arg or 2),)
    size = {"all": 1, "sqrt": math.ceil(math.sqrt(n))}.get(spec.kind, spec.arg)
    return tuple(Segment(tuple(range(i, min(i + size, n)))) for i in range(0, n, size))


def _save_ops(saved: frozenset, skipped_operand: tuple[int, int] | None, ctx: object, op: torch._ops.OpOverload,
              *args: object, **kwargs: object) -> CheckpointPolicy:
    if op is torch.ops.aten.mm.default and skipped_operand is not None and tuple(args[1].shape) == skipped_operand:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _checkpoint_kwargs(saved: SavedOps, keeps: str) -> dict[str, Callable]:
    """``checkpoint()``'s arguments for a segment that keeps ``keeps`` of ``saved``: one object for equal arguments,
    as Dynamo guards a compiled segment's graph on the context function it was traced with (a new one would
    recompile)."""
    if not keeps:
        return {}
    skipped = saved.skipped_operand if keeps == "selective" else None
    policy_fn = functools.partial(_save_ops, saved.kept_by(keeps), skipped)
    return {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy_fn)}


def _checkpoint(forward: Callable[..., torch.Tensor], *args: object, **kwargs: object) -> torch.Tensor:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _alone(item: int | Segment | Offloaded) -> int | None:
    """The block a segment of one block holds (None for anything else)."""
    if isinstance(item, Segment) and len(item.items) == 1 and isinstance(item.items[0], int):
        return item.items[0]
    return None


class CheckpointedBlocks(nn.ModuleList):
    """The model's blocks, under their own indices, run in the checkpointed segments of ``plan``; a segment that
    keeps ops' outputs (``attention``, ``selective``) keeps them from the forward instead of recomputing them. An
    offloaded block's saved tensors start back to the device when the backward of the block after it starts.

    Compiled (:meth:`compile_blocks`), a block that is a top-level segment of its own runs its checkpoint inside its
    compiled forward, where Inductor sees the segment: its policy decides which of the graph's outputs the forward
    saves, and the recomputation is part of the compiled backward. (A checkpoint around a compiled forward would
    show the policy one opaque call, and recompute the whole compiled forward.) Hooks on the block's module call
    (FSDP's) stay outside the compiled code and run once; the recomputation reads the weights the forward's graph
    saved, which FSDP gathers again for the block's backward anyway. The blocks of larger segments (``group:K``,
    ``sqrt``, ``nested``), which keep nothing, and the offloaded and kept blocks have their forward compiled alone.
    """

    def __init__(self, blocks: nn.ModuleList, plan: tuple[int | Segment | Offloaded, ...], policy: str,
                 saved: SavedOps):
        super().__init__(blocks)
        self.plan = plan
        self.policy = policy
        self.saved = saved
        self.offloads = {item.index: BlockOffload(blocks[item.index]) for item in plan if isinstance(item, Offloaded)}
        self.compiled = False
        self._inside: frozenset[int] = frozenset()  # blocks whose compiled forward runs their checkpoint

    def _run(self, items: tuple[int | Segment | Offloaded, ...], x: torch.Tensor) -> torch.Tensor:
        for position, item in enumerate(items):
            if isinstance(item, int):
                x = self[item](x)
            elif isinstance(item, Offloaded):
                with self.offloads[item.index].saving():
                    x = self[item.index](x)
            elif _alone(item) in self._inside:
                x = self[item.items[0]](x)
            else:
                x = _checkpoint(self._run, item.items, x, **_checkpoint_kwargs(self.saved, item.keeps))
            previous = items[position - 1] if position else None
            if isinstance(previous, Offloaded) and x.requires_grad:
                x.register_hook(self.offloads[previous.index].prefetch_hook)
        return x

    def compile_blocks(self) -> None:
        """Put each block's forward under ``torch.compile`` in place, a block that is a segment of its own with its
        checkpoint (class docstring). Compiled blocks share graphs: one for each kind of segment on the same shapes.

        Raises:
            TypeError: if the blocks were already compiled.
        """
        if self.compiled:
            raise TypeError("the checkpointed blocks are already compiled")
        inside = {index: item.keeps for item in self.plan if (index := _alone(item)) is not None}
        # Dynamo traces the checkpoint only with the policy's arguments as Python constants; a shape seen before made
        # dynamic would turn the skipped operand's ints symbolic. Falling back to an eager checkpoint would hide the
        # policy from Inductor (and recompute from the module's weights after FSDP swapped them out): static shapes,
        # and an error rather than a graph break.
        checkpointed = torch.compile(_checkpoint, fullgraph=True, dynamic=False)
        for index, block in enumerate(self):
            if index in inside:
                block.forward = functools.partial(checkpointed, block.forward,
                                                  **_checkpoint_kwargs(self.saved, inside[index]))
            else:
                block.forward = torch.compile(block.forward)
        self.compiled = True
        self._inside = frozenset(inside)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(self.plan, x)

    def extra_repr(self) -> str:
        segments = sum(isinstance(i, Segment) for i in self.plan)
        return f"policy={self.policy}, top_level_segments={segments}, offloaded={len(self.offloads)}"


def apply_checkpointing(model: nn.Module, policy: str | CheckpointPolicySpec,
                        saved: SavedOps = NO_SAVED_OPS) -> nn.Module:
    """Checkpoint ``model.layers`` in place according to ``policy``, the segments that keep ops' outputs keeping
    those of ``saved``; returns ``model`` (parameter names unchanged).

    Raises:
        TypeError: if ``model.layers`` is not an ``nn.ModuleList`` with a ``forward``, was already checkpointed, or
            holds blocks whose ``forward`` was replaced (compiled: checkpoint first, then compile,
            :meth:`CheckpointedBlocks.compile_blocks`).
    """
    spec = parse_policy(policy)
    if not isinstance(saved, SavedOps):
        raise TypeError(f"saved must be a SavedOps, got {type(saved).__name__}")
    layers = getattr(model, "layers", None)
    if isinstance(layers, CheckpointedBlocks):
        raise TypeError("model.layers is already checkpointed; apply a policy to a fresh model")
    if not isinstance(layers, nn.ModuleList) or type(layers).forward is nn.Module.forward:
        raise TypeError("apply_checkpointing needs model.layers to be an nn.ModuleList of blocks that its forward runs "
                        f"in order (as BasicsTransformerLM's), got {type(layers).__name__}")
    replaced = [i for i, block in enumerate(layers) if "forward" in vars(block)]
    if replaced:
        raise TypeError(f"blocks {replaced} of model.layers have their forward replaced (compiled?): checkpoint the "
                        "blocks first, then compile them, so that the compiled code holds the checkpoint")
    if spec.kind != "none":
        model.layers = CheckpointedBlocks(layers, plan_segments(len(layers), spec), str(spec), saved)
    return model


@dataclass(frozen=True)
class BlockMemory:
    """Bytes one block adds to memory in the forward, by how it is checkpointed: its output plus what autograd keeps
    for its backward beyond the block's input (which the previous block's output already counts).

    ``kept``: not checkpointed; ``selective``: checkpointed, the fused attention's and the matmuls' outputs kept (but
    the skipped one's, :class:`SavedOps`);
    ``attention``: checkpointed, the fused attention's outputs kept; ``checkpointed``: checkpointed, nothing kept
    (the output alone). ``working``: what the block's backward holds at its peak beyond its activations (gradient
    temporaries, less the activations it has freed by then). ``saves_input``: whether the block's forward keeps its
    input itself (a norm that keeps an fp32 copy of a bf16 input does not); where nothing else holds that input (a
    checkpoint holds its segment's), the previous block's output is freed once the block has run.
    """

    kept: int
    selective: int
    attention: int
    checkpointed: int
    working: int
    saves_input: bool = True

    def __post_init__(self) -> None:
        if not self.kept >= self.selective >= self.attention >= self.checkpointed > 0:
            raise ValueError(f"need kept >= selective >= attention >= checkpointed > 0 bytes, got {self.kept}, "
                             f"{self.selective}, {self.attention}, {self.checkpointed}")
        if not self.working >= 0:
            raise ValueError(f"need working >= 0 bytes, got {self.working}")

    @property
    def offloaded(self) -> int:
        """Offloaded: its output, once the copies of what it saves have left for the host."""
        return self.checkpointed


def _blocks(item: int | Segment | Offloaded) -> range:
    """The blocks an item of a plan runs (consecutive)."""
    if isinstance(item, int):
        return range(item, item + 1)
    if isinstance(item, Offloaded):
        return range(item.index, item.index + 1)
    return range(_blocks(item.items[0]).start, _blocks(item.items[-1]).stop)


def _beyond_output(memory: BlockMemory, item: int | Segment | Offloaded) -> int:
    """What an item whose backward has not started holds beyond its input and output: a block run plainly all it
    saves, a segment of one block the outputs its policy keeps, anything else nothing (a segment of several blocks
    keeps only its output, an offloaded block's saved tensors are on the host)."""
    if isinstance(item, int):
        return memory.kept - memory.checkpointed
    if isinstance(item, Segment) and item.keeps:
        return getattr(memory, item.keeps) - memory.checkpointed
    return 0


def _holds_input(memory: BlockMemory, item: int | Segment | Offloaded, top: bool, recomputed: bool) -> bool:
    """Whether ``item`` holds its input: a block run plainly if it saves it; a segment's checkpoint saves it with the
    context it runs in, through the segment's backward at the top level, and inside an outer segment's recomputation
    until the segment's own recomputation (``recomputed``) takes it out; an offloaded block saves it."""
    if isinstance(item, int):
        return memory.saves_input
    if isinstance(item, Segment):
        return top or not recomputed
    return True


def kept_bytes(memory: BlockMemory, num_blocks: int, policy: str | CheckpointPolicySpec) -> list[int]:
    """What each block keeps through the forward under ``policy``: what it saves beyond its input (the outputs a
    segment of one block keeps) and its output, if the next item of the plan (:func:`plan_segments`) holds it (the
    last block's always counts); the blocks of a segment of several blocks keep nothing but the segment's output, at
    its last block."""
    plan = plan_segments(num_blocks, policy)
    kept = [0] * num_blocks
    for position, item in enumerate(plan):
        output = position + 1 == len(plan) or _holds_input(memory, plan[position + 1], True, False)
        kept[_blocks(item)[-1]] = _beyond_output(memory, item) + output * memory.checkpointed
    return kept


def _backward_of(memory: BlockMemory, plan: tuple[int | Segment | Offloaded, ...], block: int) -> int:
    """The blocks' activations at the peak of ``block``'s backward (:func:`backward_bytes`)."""
    held: set[int] = set()  # blocks whose output is alive (-1: the blocks' input, not counted here)
    total = memory.kept + memory.working
    items, top = plan, True  # the items of the plan, then of each segment holding the block, recomputed
    while True:
        t = next(position for position, item in enumerate(items) if block in _blocks(item))
        total += sum(_beyond_output(memory, item) for item in items[:t])
        held.update(_blocks(item).start - 1 for position, item in enumerate(items[: t + 1])
                    if _holds_input(memory, item, top, position == t))
        if top and t and isinstance(items[t - 1], Offloaded):
            total += memory.kept  # the offloaded block's saved tensors coming back
        if not isinstance(items[t], Segment):
            return total + len(held - {-1}) * memory.checkpointed
        items, top = items[t].items, False


def backward_bytes(memory: BlockMemory, num_blocks: int, policy: str | CheckpointPolicySpec) -> list[int]:
    """What the blocks' activations hold at the peak of each block's backward under ``policy``, by how the plan's
    segments run (:class:`CheckpointedBlocks`, non-reentrant ``torch.utils.checkpoint``): the block's own activations
    (kept, or recomputed) and its working set, what each item before it keeps (:func:`kept_bytes`), and what the
    recomputations of the segments that hold it keep. A segment is recomputed when the backward first needs one of
    its saved tensors, in its last block's backward, and its recomputation keeps what its blocks save, each block's
    freed by its own backward: a segment of K blocks holds those of the first j + 1 in the backward of its
    (j + 1)-th block, its blocks' outputs alive where the next block saves its input. A segment of segments
    (``nested``) keeps, recomputed, the inputs of its segments, each until that segment's own recomputation takes it
    (a recomputation stops once it has saved again what the first forward saved, checkpoint's early stop: its last
    segment is not run). The backward of the block after an offloaded one also holds the offloaded block's saved
    tensors, fetched back.

    The blocks' input (the embedding's output) is not counted.
    """
    plan = plan_segments(num_blocks, policy)
    return [_backward_of(memory, plan, block) for block in range(num_blocks)]


def recomputes_earlier_blocks(num_blocks: int, policy: str | CheckpointPolicySpec) -> list[bool]:
    """Whether each block's backward begins by running the forward of earlier blocks again under ``policy``: it is
    the last block of a segment of several, whose recomputation runs all but the segment's last item (the rest of a
    segment's blocks are recomputed by then)."""

    def ends(item: int | Segment | Offloaded) -> set[int]:
        if not isinstance(item, Segment):
            return set()
        inside = set().union(*(ends(i) for i in item.items))
        if item.num_blocks > 1:
            inside.add(_blocks(item)[-1])
        return inside

    last = set().union(*(ends(item) for item in plan_segments(num_blocks, policy)))
    return [block in last for block in range(num_blocks)]


def activation_peak_bytes(memory: BlockMemory, num_blocks: int, policy: str | CheckpointPolicySpec) -> int:
    """The blocks' share of the peak under ``policy``: the largest of :func:`backward_bytes`. For the policies that
    checkpoint blocks one by one, or keep them, the last block's backward: what every other block keeps, its own
    activations (kept or recomputed) and working set; with offloaded blocks, maybe the backward of a block after
    one, fetching what the offloaded block saved (the blocks after it have freed theirs; the copies out are counted
    as done before the backward: the later blocks' forwards hide them). For segments of several blocks, the
    backward of the last block of one of them, all the segment's blocks recomputed."""
    return max(backward_bytes(memory, num_blocks, policy))


def policy_for_budget(memory: BlockMemory, num_blocks: int, budget_bytes: float, *,
                      keep_attention: bool = True, kept_budget_bytes: float | None = None) -> CheckpointPolicySpec:
    """The policy that recomputes least with an :func:`activation_peak_bytes` of at most ``budget_bytes`` (and, with
    ``kept_budget_bytes``, all blocks keeping at most that through the forward), by the rule of the module
    docstring: ``none`` if it fits; else ``selective:M`` with M as small as fits; else N blocks recomputing their
    matmuls with N as small as fits, then M ``selective`` blocks after them with M as small as fits
    (M < n - N: the last block stays kept): with ``keep_attention`` the N keep their attention outputs
    (``attention:N+selective:M``), and where none of those fits, ``first:N`` with N as small as fits; without, they
    keep nothing (``first:N+selective:M``). ``all`` if nothing fits.

    Args:
        memory: what one block keeps in each mode.
        num_blocks: blocks in the model.
        budget_bytes: memory for the blocks' activations (the step's memory cap less what lives through the step:
            weights, optimizer state, the LM head's buffers).
        keep_attention: whether a block that recomputes its matmuls may keep its attention outputs (a fused
            attention op; the ``attention`` tier); otherwise it keeps nothing (``first``).
        kept_budget_bytes: the most the blocks may keep together (:func:`kept_bytes`), for a moment after the last
            block's forward that adds to all of it (the loss's); None: no such bound.
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    if not budget_bytes > 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes!r}")
    n = num_blocks
    # A selective last block recomputes into more than it keeps whole: it stays kept in these.
    candidates = [CheckpointPolicySpec("none"), *(CheckpointPolicySpec("selective", m) for m in range(1, n))]
    if keep_attention:
        candidates += [CheckpointPolicySpec("attention", k, m) for k in range(1, n + 1) for m in range(n - k)]
        candidates += [CheckpointPolicySpec("first", k) for k in range(1, n + 1)]
    else:
        candidates += [CheckpointPolicySpec("first", k, m) for k in range(1, n + 1) for m in range(n - k)]
    for spec in candidates:
        fits_end = kept_budget_bytes is None or sum(kept_bytes(memory, num_blocks, spec)) <= kept_budget_bytes
        if fits_end and activation_peak_bytes(memory, num_blocks, spec) <= budget_bytes:
            return spec
    return CheckpointPolicySpec("all")
