"""Offloaded blocks (``offload`` policies): the backward reads the host copies, each saved tensor is copied once and
the weights not at all, the copies come back when the next block's backward starts; on a GPU, device memory drops
by what the blocks saved and the gradients are the plain model's, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from cs336_basics.model import BasicsTransformerLM
from cs336_basics.nn_utils import cross_entropy
from cs336_sharding.checkpointing import (
    BlockMemory,
    Offloaded,
    activation_peak_bytes,
    apply_checkpointing,
    parse_policy,
    plan_segments,
)
from cs336_sharding.offload import MIN_BYTES, BlockOffload
from cs336_sharding.parallelize import parallelize


def _model(device: str = "cpu", d_model: int = 256, d_ff: int = 1024) -> BasicsTransformerLM:
    # Large enough that the block's activations pass MIN_BYTES: 4 x 256 tokens x 256 x 4 bytes = 1 MiB.
    torch.manual_seed(0)
    return BasicsTransformerLM(vocab_size=64, context_length=256, d_model=d_model, num_layers=4, num_heads=4,
                               d_ff=d_ff, device=torch.device(device))


def _batch(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 64, (2, 4, 256), generator=gen)
    return tokens.to(device), targets.to(device)


def _grads(model: BasicsTransformerLM, tokens: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    cross_entropy(model(tokens), targets).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_the_backward_reads_the_host_copies() -> None:
    base, (tokens, targets) = _model(), _batch()
    want = _grads(copy.deepcopy(base), tokens, targets)
    model = apply_checkpointing(copy.deepcopy(base), "offload:2")
    loss = cross_entropy(model(tokens), targets)
    offloads = model.layers.offloads
    assert sorted(offloads) == [0, 1] and all(o.offloaded_bytes >= MIN_BYTES for o in offloads.values())
    loss.backward()
    for got, ref in zip((p.grad for p in model.parameters()), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    # The same step with block 0's copies overwritten after the forward: its gradients change, the others' do not.
    model.zero_grad()
    loss = cross_entropy(model(tokens), targets)
    for saved in offloads[0]._saved:
        saved.host.zero_()
    loss.backward()
    want_by_name = dict(zip((n for n, _ in base.named_parameters()), want, strict=True))
    changed = {n.split(".")[1] for n, p in model.named_parameters()
               if n.startswith("layers.") and not torch.equal(p.grad, want_by_name[n])}
    assert changed == {"0"}


def test_each_saved_tensor_is_copied_once_and_weights_stay() -> None:
    block, x = _model().layers[0], torch.randn(4, 256, 256, requires_grad=True)
    offload = BlockOffload(block)
    with offload.saving():
        y = block(x)
    hosts = [s.host for s in offload._saved]
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    assert len({h.data_ptr() for h in hosts}) == len(hosts) > 0
    assert all(s.source is None for s in offload._saved)  # the forward's references are dropped
    # The normed input feeds q, k and v (and the gate's two projections): saved more than once, copied once.
    assert any(s.uses > 1 for s in offload._saved)
    assert not weights & {s.host.untyped_storage().data_ptr() for s in offload._saved}
    assert sum(h.numel() for h in hosts) * 4 == offload.offloaded_bytes
    y.sum().backward()
    assert all(s.uses == 0 for s in offload._saved)
    # The next forward reuses the host buffers.
    with offload.saving():
        block(x)
    assert [s.host.data_ptr() for s in offload._saved] == [h.data_ptr() for h in hosts]

    with pytest.raises(TypeError, match="the block"):
        BlockOffload(lambda t: t)


def test_a_view_copied_contiguous_keeps_its_host_buffer() -> None:
    offload, base = BlockOffload(torch.nn.Linear(1, 1)), torch.randn(1024, 1024, requires_grad=True)
    hosts = []
    for _ in range(2):
        with offload.saving():
            y = torch.sin(base[:, :512])  # sin saves its input: a column slice, not dense
        (saved,) = offload._saved
        assert saved.host.is_contiguous() and saved.host.shape == (1024, 512)
        hosts.append(saved.host.data_ptr())
        y.sum().backward()
    assert hosts[0] == hosts[1]
    torch.testing.assert_close(base.grad[:, :512], 2 * torch.cos(base.detach()[:, :512]))


def test_offload_under_fsdp_leaves_the_gathered_weights_to_it() -> None:
    base, (tokens, targets) = _model(), _batch()
    want = _grads(copy.deepcopy(base), tokens, targets)
    plain = apply_checkpointing(copy.deepcopy(base), "offload:2")
    _grads(plain, tokens, targets)
    fsdp = parallelize(copy.deepcopy(base), checkpoint="offload:2")
    cross_entropy(fsdp(tokens), targets).backward()
    fsdp.finish_gradient_synchronization()
    for got, ref in zip((p.grad for p in fsdp.parameters()), want, strict=True):  # one rank: shards are whole
        torch.testing.assert_close(got.view(ref.shape), ref, rtol=1e-6, atol=1e-7)
    offloads = fsdp.module.layers.offloads
    assert [o.offloaded_bytes for o in offloads.values()] == [o.offloaded_bytes for o in plain.layers.offloads.values()]


def test_copies_come_back_when_the_next_blocks_backward_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    model, (tokens, targets) = apply_checkpointing(_model(), "offload:2+selective:1"), _batch()
    calls: list[int] = []
    for index, offload in model.layers.offloads.items():
        monkeypatch.setattr(offload, "prefetch", lambda i=index, o=offload: (calls.append(i), BlockOffload.prefetch(o)))
    loss = cross_entropy(model(tokens), targets)
    assert calls == []
    loss.backward()
    assert calls == [1, 0]  # in the backward of blocks 2 and 1


def test_offload_policies_plan_and_count() -> None:
    spec = parse_policy("offload:2+selective:1")
    assert str(spec) == "offload:2+selective:1"
    assert spec.per_block(4) == ["offloaded", "offloaded", "selective", "kept"]
    plan = plan_segments(4, spec)
    assert plan[:2] == (Offloaded(0), Offloaded(1)) and plan[3] == 3
    assert plan_segments(3, "offload") == (Offloaded(0), Offloaded(1), Offloaded(2))
    memory = BlockMemory(kept=100, selective=60, attention=12, checkpointed=10, working=30)
    # Block 2's backward with block 1 coming back (10 + 10 + 100 + 100 + 30) tops block 1's with block 0 coming back
    # (10 + 100 + 100 + 30) and the last block's (10 + 10 + 60 + 100 + 30).
    assert activation_peak_bytes(memory, 4, "offload:2+selective:1") == 250
    assert activation_peak_bytes(memory, 3, "offload") == 10 + 10 + 2 * 100 + 30
    with pytest.raises(ValueError, match="combine two policies"):
        parse_policy("offload+selective:2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_offload_frees_device_memory_and_matches_bitwise() -> None:
    base, (tokens, targets) = _model("cuda", 1024, 4096), _batch("cuda")
    want = _grads(copy.deepcopy(base), tokens, targets)
    held = {}
    for policy in ("none", "offload:3"):
        model = apply_checkpointing(copy.deepcopy(base), policy)
        before = torch.cuda.memory_allocated()
        loss = cross_entropy(model(tokens), targets)
        torch.cuda.synchronize()
        held[policy] = torch.cuda.memory_allocated() - before
        loss.backward()
        for got, ref in zip((p.grad for p in model.parameters()), want, strict=True):
            assert torch.equal(got, ref)
        if policy != "none":
            saved = sum(o.offloaded_bytes for o in model.layers.offloads.values())
            assert all(s.host.is_pinned() for o in model.layers.offloads.values() for s in o._saved)
        del model, loss
    # Three blocks' saved tensors left the device (once the copies are done the allocator reuses them).
    assert held["none"] - held["offload:3"] >= 0.9 * saved
