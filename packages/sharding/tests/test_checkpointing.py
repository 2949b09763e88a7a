"""Every checkpointing policy gives the loss and gradients of the plain model, and saves less; the attention policies
keep the fused attention's outputs (SDPA's and our Triton kernel's operator); compiled, a block checkpointed on its
own saves what its policy keeps; the budget rule picks the policy that recomputes least within a memory budget."""

from __future__ import annotations

import copy
import dataclasses
import re
import weakref

import pytest
import torch
from cs336_basics.model import BasicsTransformerLM, BlockKernels, sdpa_attention
from cs336_basics.nn_utils import cross_entropy
from cs336_sharding.checkpointing import (
    BlockMemory,
    CheckpointedBlocks,
    CheckpointPolicySpec,
    SavedOps,
    Segment,
    activation_peak_bytes,
    apply_checkpointing,
    backward_bytes,
    kept_bytes,
    parse_policy,
    plan_segments,
    policy_for_budget,
    recomputes_earlier_blocks,
)
from cs336_sharding.parallelize import apply_compile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

POLICIES = ["all", "group:2", "group:3", "first:2", "first:1+selective:2", "sqrt", "nested", "nested:3", "selective",
            "selective:3", "attention", "attention:1+selective:2"]
# Inductor's fused kernels sum in another order than the eager ops: fp32 rounding.
COMPILED_ATOL, COMPILED_RTOL = 1e-6, 1e-5


def _model() -> BasicsTransformerLM:
    torch.manual_seed(0)
    return BasicsTransformerLM(vocab_size=37, context_length=11, d_model=24, num_layers=5, num_heads=3, d_ff=40)


def _saved_bytes(model: BasicsTransformerLM, tokens: torch.Tensor) -> int:
    """Bytes of the storages autograd saves in the forward of ``model(tokens)``, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return sum(saved.values())


def _triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    from cs336_kernels import flash_attention  # on CPU the interpreter must be chosen first (conftest.py)

    return flash_attention(q, k, v, is_causal=is_causal)


ATTENTIONS = {"sdpa": sdpa_attention, "triton": _triton_attention}


def _attention_op(name: str) -> torch._ops.OpOverload:
    """The operator an attention of :data:`ATTENTIONS` runs on CPU (our kernel's once it is imported)."""
    if name == "triton":
        import cs336_kernels  # noqa: F401  registers torch.ops.cs336

        return torch.ops.cs336.flash_attention_forward.default
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _loss_and_grads(model: BasicsTransformerLM, tokens: torch.Tensor, targets: torch.Tensor):
    loss = cross_entropy(model(tokens), targets)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_matches_no_checkpointing(policy: str) -> None:
    base = _model()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 37, (3, 11), generator=gen)
    targets = torch.randint(0, 37, (3, 11), generator=gen)
    ref_loss, ref_grads = _loss_and_grads(copy.deepcopy(base), tokens, targets)
    model = apply_checkpointing(copy.deepcopy(base), policy)
    assert isinstance(model.layers, CheckpointedBlocks)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in base.named_parameters()]  # names kept
    loss, grads = _loss_and_grads(model, tokens, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert len(grads) == len(ref_grads)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("policy", ["all", "group:2", "sqrt", "nested", "selective", "attention"])
def test_policy_saves_less_for_backward(policy: str) -> None:
    tokens = torch.randint(0, 37, (3, 11), generator=torch.Generator().manual_seed(2))
    assert _saved_bytes(apply_checkpointing(_model(), policy), tokens) < _saved_bytes(_model(), tokens)


class _CountOp(TorchDispatchMode):
    """Counts the calls of one operator (by name) dispatched while active."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.calls = name, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.name() == self.name
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("attention", "op_name"), [
    ("sdpa", "aten::_scaled_dot_product_flash_attention_for_cpu"),
    pytest.param("triton", "cs336::flash_attention_forward", marks=pytest.mark.slow),  # the interpreter: seconds
])
@pytest.mark.parametrize(("policy", "recomputed"), [("all", 2), ("attention", 0), ("selective", 0)])
def test_attention_policy_does_not_recompute_attention(attention: str, op_name: str, policy: str,
                                                       recomputed: int) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, targets = torch.randint(0, 37, (3, 11), generator=gen), torch.randint(0, 37, (3, 11), generator=gen)
    torch.manual_seed(0)  # head dim 16, the Triton kernel's smallest
    base = BasicsTransformerLM(vocab_size=37, context_length=11, d_model=32, num_layers=2, num_heads=2, d_ff=40,
                               kernels=BlockKernels(attention=ATTENTIONS[attention]))
    ref_loss, ref_grads = _loss_and_grads(copy.deepcopy(base), tokens, targets)
    model = apply_checkpointing(copy.deepcopy(base), policy, SavedOps(attention=frozenset({_attention_op(attention)})))
    loss = cross_entropy(model(tokens), targets)
    with _CountOp(op_name) as counter:
        loss.backward()
    assert counter.calls == recomputed  # one per block under "all"
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=0, atol=0)
    for p, ref in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)


class _Outputs(TorchDispatchMode):
    """Weak references on every operator's outputs while active; ``live_bytes``: the storages some are still on."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def live_bytes(self) -> int:
        alive = [t for ref in self.refs if (t := ref()) is not None]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}.values())


@pytest.mark.parametrize("d_ff", [48, 32])
def test_selective_keeps_the_matmul_outputs_its_recomputation_uses(d_ff: int) -> None:
    # The down projection's output feeds only the residual add: not kept when its weight operand's shape is named
    # (it tells it apart where d_ff != d_model), and never recomputed, as no matmul is.
    d, tokens = 32, torch.randint(0, 37, (2, 64), generator=torch.Generator().manual_seed(4))
    kept, matmuls = {}, {}
    for policy in ("none", "attention", "selective"):
        torch.manual_seed(0)
        model = BasicsTransformerLM(vocab_size=37, context_length=64, d_model=d, num_layers=2, num_heads=2,
                                    d_ff=d_ff, kernels=BlockKernels(attention=sdpa_attention))
        apply_checkpointing(model, policy, SavedOps(attention=frozenset({_attention_op("sdpa")}),
                                                    skipped_operand=(d_ff, d) if d_ff != d else None))
        with _Outputs() as outputs:
            x = model.layers(model.token_embeddings(tokens))
        kept[policy] = outputs.live_bytes() - x.untyped_storage().nbytes()
        with _CountOp("aten::mm") as counter:
            x.sum().backward()
        matmuls[policy] = counter.calls
    n_outputs = 4 * d + 2 * d_ff + (d if d_ff == d else 0)  # q, k, v, out-projection, w1, w3 (and w2)
    assert kept["selective"] - kept["attention"] == 2 * 128 * 4 * n_outputs  # 2 blocks, 128 tokens, fp32
    assert matmuls["selective"] == matmuls["none"] == 2 * 7 * 2 < matmuls["attention"]


def _saved_activations(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """``block(x)`` and the shapes of the floating-point storages autograd saves in it: not the block's parameters,
    buffers or ``x`` (a checkpoint that replays random ops keeps the generator's state too, as bytes)."""
    skip = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers(), x]}
    saved: dict[int, tuple[int, ...]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = tuple(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    return out, sorted(saved.values())


@pytest.mark.slow
def test_compiled_blocks_save_what_their_checkpoints_policy_keeps() -> None:
    # Inductor on CPU, each block compiled with its checkpoint and called alone: the forward's graph of the fully
    # checkpointed block saves nothing, the selective one the outputs of the matmuls (but the down projection's) and
    # of the attention op, the kept one more. Were the checkpoint outside the compiled forward, each block would
    # save the compiled forward's whole set here.
    batch, seq, d, d_ff, heads = 2, 16, 32, 48, 2
    torch.manual_seed(0)
    base = BasicsTransformerLM(vocab_size=37, context_length=seq, d_model=d, num_layers=3, num_heads=heads, d_ff=d_ff,
                               kernels=BlockKernels(attention=sdpa_attention))
    saved = SavedOps(attention=frozenset({_attention_op("sdpa")}), skipped_operand=(d_ff, d))
    model = apply_compile(apply_checkpointing(copy.deepcopy(base), "first:1+selective:1", saved))
    gen = torch.Generator().manual_seed(5)
    tokens, targets = (torch.randint(0, 37, (batch, seq), generator=gen) for _ in range(2))
    x, kept = model.token_embeddings(tokens), []
    for block in model.layers:
        x, shapes = _saved_activations(block, x)
        kept.append(shapes)
    n = batch * seq
    selective = sorted([(n, d)] * 4 + [(n, d_ff)] * 2 + [(batch, heads, seq, d // heads), (batch, heads, seq)])
    assert kept[:2] == [[], selective]
    assert len(kept[2]) > len(selective)
    ref_loss, ref_grads = _loss_and_grads(copy.deepcopy(base), tokens, targets)
    loss, grads = _loss_and_grads(model, tokens, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=COMPILED_RTOL, atol=COMPILED_ATOL)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=COMPILED_RTOL, atol=COMPILED_ATOL)


def test_tiers_are_parsed_and_planned_in_order() -> None:
    spec = parse_policy("attention:1+selective:2")
    assert spec == CheckpointPolicySpec("attention", 1, 2) and str(spec) == "attention:1+selective:2"
    assert spec.per_block(5) == ["attention", "selective", "selective", "kept", "kept"]
    assert parse_policy("selective:2").per_block(3) == ["selective", "selective", "kept"]
    plan = apply_checkpointing(_model(), spec).layers.plan
    assert [s.keeps if isinstance(s, Segment) else "kept" for s in plan] == spec.per_block(5)
    spec = parse_policy("first:2+selective:1")
    assert spec == CheckpointPolicySpec("first", 2, 1) and str(spec) == "first:2+selective:1"
    assert spec.per_block(5) == ["checkpointed", "checkpointed", "selective", "kept", "kept"]
    assert [s.keeps if isinstance(s, Segment) else None for s in apply_checkpointing(_model(), spec).layers.plan] == [
        "", "", "selective", None, None]
    assert str(CheckpointPolicySpec("first", 2, 0)) == "first:2"
    for bad, message in [("group:1+selective:2", "only 'first:N"), ("attention+selective:2", "only 'first:N"),
                         ("first:1+selective", "only 'first:N"), ("first:1+attention:2", "only 'first:N")]:
        with pytest.raises(ValueError, match=message):
            parse_policy(bad)
    with pytest.raises(ValueError, match="follows 'first:N', 'attention:N'"):
        CheckpointPolicySpec("group", 1, 2)
    with pytest.raises(ValueError, match="per-block tiers cover"):
        parse_policy("group:2").per_block(4)


def test_segments_follow_the_policy() -> None:
    plan = apply_checkpointing(_model(), "group:2").layers.plan
    assert [s.num_blocks for s in plan] == [2, 2, 1]
    plan = apply_checkpointing(_model(), "first:2").layers.plan
    assert [isinstance(s, Segment) for s in plan] == [True, True, False, False, False]
    (root,) = apply_checkpointing(_model(), "nested:2").layers.plan

    def shape(s: Segment):  # nested lengths of segments down to the blocks
        return [shape(i) if isinstance(i, Segment) else 1 for i in s.items]

    assert shape(root) == [[[[1], [1]], [1]], [[1], [1]]]
    assert [s.num_blocks for s in apply_checkpointing(_model(), "sqrt").layers.plan] == [3, 2]


@pytest.mark.parametrize(
    ("text", "message"),
    [("group", "needs a count"), ("first:x", "integer after"), ("nested:1", ">= 2"), ("all:3", "takes no count"),
     ("bogus", "unknown checkpoint policy")],
)
def test_bad_policies_are_rejected(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_policy(text)


@pytest.mark.parametrize(("policy", "named"), [("first:99", 99), ("attention:6", 6), ("offload:3+selective:3", 6),
                                              ("selective:9", 9)])
def test_a_policy_naming_more_blocks_than_the_model_has_is_rejected(policy: str, named: int) -> None:
    with pytest.raises(ValueError, match=rf"^checkpoint policy {re.escape(policy)} names {named} blocks, but the "
                                         r"model has 5$"):
        apply_checkpointing(_model(), policy)


def test_double_application_and_non_modulelist_are_rejected() -> None:
    model = apply_checkpointing(_model(), "all")
    with pytest.raises(TypeError, match="already checkpointed"):
        apply_checkpointing(model, "all")
    with pytest.raises(TypeError, match="nn.ModuleList"):
        apply_checkpointing(torch.nn.Linear(2, 2), "all")
    with pytest.raises(TypeError, match="saved must be a SavedOps"):
        apply_checkpointing(_model(), "selective", {"attention": frozenset()})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="frozenset of operator overloads"):
        SavedOps(attention={torch.ops.aten.mm.default})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="skipped_operand must be None or a"):
        SavedOps(skipped_operand=(40, 0))


# The budget rule, on what one block keeps in each mode.

_MEMORY = BlockMemory(kept=100, selective=60, attention=12, checkpointed=10, working=30)


def test_peak_is_what_every_other_block_keeps_plus_the_last_blocks_activations_and_working_set() -> None:
    assert activation_peak_bytes(_MEMORY, 5, "none") == 4 * 100 + 100 + 30
    assert activation_peak_bytes(_MEMORY, 5, "all") == 4 * 10 + 100 + 30
    assert activation_peak_bytes(_MEMORY, 5, "attention") == 4 * 12 + 100 + 30
    assert activation_peak_bytes(_MEMORY, 5, "attention:2") == 2 * 12 + 2 * 100 + 100 + 30
    assert activation_peak_bytes(_MEMORY, 5, "attention:1+selective:2") == 12 + 2 * 60 + 100 + 100 + 30
    assert activation_peak_bytes(_MEMORY, 5, "selective:3") == 3 * 60 + 100 + 100 + 30
    assert kept_bytes(_MEMORY, 5, "first:1+selective:2") == [10, 60, 60, 100, 100]
    assert activation_peak_bytes(_MEMORY, 5, "first:1+selective:2") == 10 + 2 * 60 + 100 + 100 + 30
    # The last block's activations are all alive in its backward, recomputed or kept: checkpointing it saves nothing.
    assert activation_peak_bytes(_MEMORY, 5, "first:4") == activation_peak_bytes(_MEMORY, 5, "all")
    with pytest.raises(ValueError, match="kept >= selective >= attention >= checkpointed"):
        BlockMemory(kept=2, selective=1, attention=2, checkpointed=1, working=0)
    with pytest.raises(ValueError, match="working >= 0"):
        BlockMemory(kept=2, selective=2, attention=2, checkpointed=1, working=-1)


def test_a_kept_block_that_does_not_save_its_input_frees_the_output_before_it() -> None:
    memory = dataclasses.replace(_MEMORY, saves_input=False)
    assert kept_bytes(memory, 3, "none") == [90, 90, 100]  # outputs 0 and 1 freed; the last one counted
    assert activation_peak_bytes(memory, 3, "none") == 90 + 90 + 100 + 30
    assert kept_bytes(memory, 3, "first:1") == [0, 90, 100]  # block 1 drops block 0's output, not block 0's input
    assert kept_bytes(memory, 3, "all") == [10, 10, 10]  # a checkpoint keeps its segment's input


def test_segments_of_several_blocks_hold_their_blocks_recomputed_in_their_last_blocks_backward() -> None:
    # group:2 on 5 blocks: segments (0, 1), (2, 3), (4). The forward keeps each segment's output (its input is the
    # previous one's). Block 3's backward recomputes block 2 and 3: block 1's output (segment (2, 3)'s input, which
    # its checkpoint holds), block 2's saved tensors (90) and its output, which block 3 saves (10), then block 3's
    # activations and working set.
    assert kept_bytes(_MEMORY, 5, "group:2") == [0, 10, 0, 10, 10]
    assert backward_bytes(_MEMORY, 5, "group:2") == [100 + 30, 100 + 100 + 30, 10 + 100 + 30, 10 + 100 + 100 + 30,
                                                   10 + 10 + 100 + 30]
    assert activation_peak_bytes(_MEMORY, 5, "group:2") == 240
    assert recomputes_earlier_blocks(5, "group:2") == [False, True, False, True, False]
    # Blocks that do not save their input: a recomputed block's output is freed inside its segment.
    memory = dataclasses.replace(_MEMORY, saves_input=False)
    assert backward_bytes(memory, 5, "group:2") == [130, 90 + 130, 10 + 130, 10 + 90 + 130, 20 + 130]
    # group:3: (0, 1, 2), (3, 4); the short last segment is not the peak.
    assert backward_bytes(_MEMORY, 5, "group:3") == [130, 230, 330, 10 + 130, 10 + 100 + 130]
    assert activation_peak_bytes(_MEMORY, 5, "sqrt") == activation_peak_bytes(_MEMORY, 5, "group:3") == 330


def test_nested_segments_hold_the_inputs_of_the_segments_not_yet_recomputed() -> None:
    # nested:2 on 4 blocks: ((0), (1)), ((2), (3)) in one segment, which keeps its output alone. Block 3's backward
    # recomputes the outer segment up to the last inner one's input (blocks 0 and 1 run, block 1's output kept for
    # segment (2, 3)), that segment up to (3)'s input (block 2 runs, its output kept), then block 3: block 1's output
    # waits for (2)'s recomputation, block 2's is saved by block 3. Block 2 and block 1 each hold their input alone.
    assert kept_bytes(_MEMORY, 4, "nested:2") == [0, 0, 0, 10]
    assert backward_bytes(_MEMORY, 4, "nested:2") == [130, 10 + 130, 10 + 130, 10 + 10 + 130]
    assert activation_peak_bytes(_MEMORY, 4, "nested:2") == 150 < activation_peak_bytes(_MEMORY, 4, "all") == 160
    assert recomputes_earlier_blocks(4, "nested:2") == [False, True, False, True]
    # Without blocks saving their input, a block's input is freed once its segment's recomputation has taken it.
    memory = dataclasses.replace(_MEMORY, saves_input=False)
    assert backward_bytes(memory, 4, "nested:2") == [130, 130, 130, 10 + 130]


@pytest.mark.parametrize(("budget", "keep_attention", "policy"), [
    (530, True, "none"),  # everything fits kept
    (529, True, "selective:1"),  # 60 + 3 * 100 + 130 = 490: matmuls are not recomputed
    (370, True, "selective:4"),  # 4 * 60 + 130: every block but the last
    (369, True, "attention:1+selective:2"),  # 12 + 2 * 60 + 100 + 130 = 362: one block recomputes its matmuls
    (300, True, "attention:2+selective:2"),  # 2 * 12 + 2 * 60 + 130 = 274; attention:1+selective:3 needs 322
    (178, True, "attention:4"),  # as little as attention:5, and the last block is not recomputed
    (177, True, "first:4"),  # no room for the attention outputs
    (169, True, "all"),  # nothing fits: the least memory
    # Without the attention tier: kept, selective or fully checkpointed blocks, in the same order.
    (530, False, "none"),
    (370, False, "selective:4"),
    (369, False, "first:1+selective:2"),  # 10 + 2 * 60 + 100 + 130 = 360; first:1+selective:1 needs 400
    (300, False, "first:2+selective:2"),  # 2 * 10 + 2 * 60 + 130 = 270; first:1+selective:3 needs 320
    (178, False, "first:4"),  # 4 * 10 + 130 = 170; first:3+selective:1 needs 220
    (169, False, "all"),
])
def test_budget_policy_recomputes_least_within_the_budget(budget: int, keep_attention: bool, policy: str) -> None:
    spec = policy_for_budget(_MEMORY, 5, budget, keep_attention=keep_attention)
    assert str(spec) == policy
    if policy != "all":
        assert activation_peak_bytes(_MEMORY, 5, spec) <= budget


@pytest.mark.parametrize(("kept_budget", "policy"), [
    (500, "none"),  # 5 * 100: the blocks' activations whole fit with the moment after them
    (499, "selective:1"),  # 60 + 4 * 100 = 460
    (379, "selective:4"),  # 4 * 60 + 100 = 340; selective:3 keeps 380
    (171, "attention:4"),  # 4 * 12 + 100 = 148; attention:3+selective:1 keeps 196
    (147, "first:4"),  # 4 * 10 + 100 = 140: the attention tier leaves the last block kept
    (139, "first:5"),  # 5 * 10
    (49, "all"),  # nothing fits: the least memory
])
def test_budget_policy_also_keeps_within_a_bound_on_all_blocks_activations(kept_budget: int, policy: str) -> None:
    # A moment after the last block's forward (the loss's) adds to what every block keeps: a bound on that sum.
    spec = policy_for_budget(_MEMORY, 5, 530, kept_budget_bytes=kept_budget)
    assert str(spec) == policy
    if policy != "all":
        assert sum(kept_bytes(_MEMORY, 5, spec)) <= kept_budget


def test_attention_with_a_count_checkpoints_the_first_blocks() -> None:
    plan = plan_segments(5, "attention:2")
    assert [not isinstance(i, int) for i in plan] == [True, True, False, False, False]
    assert plan_segments(5, "attention") == plan_segments(5, "attention:5")
    with pytest.raises(ValueError, match="positive"):
        policy_for_budget(_MEMORY, 5, 0)
    assert str(CheckpointPolicySpec("attention", 3)) == "attention:3"
