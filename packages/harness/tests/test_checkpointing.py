"""Every checkpointing policy gives the loss and gradients of the plain model, and saves less."""

from __future__ import annotations

import copy

import pytest
import torch
from cs336_basics.model import BasicsTransformerLM
from cs336_basics.nn_utils import cross_entropy
from cs336_harness.studies.attention_impls import get_attention
from cs336_harness.studies.residuals import count_residuals
from cs336_sharding.checkpointing import CheckpointedBlocks, Segment, apply_checkpointing, parse_policy
from torch.utils._python_dispatch import TorchDispatchMode

POLICIES = ["all", "group:2", "group:3", "first:2", "sqrt", "nested", "nested:3", "selective", "attention"]


def _model() -> BasicsTransformerLM:
    torch.manual_seed(0)
    return BasicsTransformerLM(vocab_size=37, context_length=11, d_model=24, num_layers=5, num_heads=3, d_ff=40)


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
    plain = _model()
    _, full = count_residuals(plain, tokens, params=plain, track=False)
    ckpt = apply_checkpointing(_model(), policy)
    _, reduced = count_residuals(ckpt, tokens, params=ckpt, track=False)
    assert reduced.total_bytes < full.total_bytes


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
                               attention=get_attention(attention))
    ref_loss, ref_grads = _loss_and_grads(copy.deepcopy(base), tokens, targets)
    model = apply_checkpointing(copy.deepcopy(base), policy)
    loss = cross_entropy(model(tokens), targets)
    with _CountOp(op_name) as counter:
        loss.backward()
    assert counter.calls == recomputed  # one per block under "all"
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=0, atol=0)
    for p, ref in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)


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


def test_double_application_and_non_modulelist_are_rejected() -> None:
    model = apply_checkpointing(_model(), "all")
    with pytest.raises(TypeError, match="already checkpointed"):
        apply_checkpointing(model, "all")
    with pytest.raises(TypeError, match="nn.ModuleList"):
        apply_checkpointing(torch.nn.Linear(2, 2), "all")
