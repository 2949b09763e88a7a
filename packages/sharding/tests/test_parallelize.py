"""parallelize composes checkpointing and FSDP in place (names kept) and trains as the plain model does; its steps
reject models they cannot change. On two ranks it is exercised by the harness's leaderboard step."""

from __future__ import annotations

import copy

import pytest
import torch
from cs336_basics.model import BasicsTransformerLM
from cs336_sharding.checkpointing import CheckpointedBlocks, apply_checkpointing
from cs336_sharding.fsdp import FSDP
from cs336_sharding.parallelize import apply_compile, parallelize


def _model() -> BasicsTransformerLM:
    torch.manual_seed(0)
    return BasicsTransformerLM(vocab_size=37, context_length=11, d_model=24, num_layers=3, num_heads=3, d_ff=40)


def test_parallelize_checkpoints_then_shards_and_trains_as_the_plain_model() -> None:
    plain = _model()
    model = parallelize(copy.deepcopy(plain), checkpoint="group:2")
    assert isinstance(model, FSDP) and isinstance(model.module.layers, CheckpointedBlocks)
    assert [n for n, _ in model.module.named_parameters()] == [n for n, _ in plain.named_parameters()]
    gen = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 37, (3, 11), generator=gen), torch.randint(0, 37, (3, 11), generator=gen)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, model)]
    for _ in range(2):
        for m, opt in zip((plain, model), opts, strict=True):
            opt.zero_grad()
            m(tokens, targets).backward()
            if m is model:
                model.finish_gradient_synchronization()
            opt.step()
    full = model.gather_full_params()
    for name, p in plain.named_parameters():
        assert torch.equal(full[name], p.detach()), name  # one rank: the same operations, bit for bit


def test_steps_reject_what_they_cannot_change() -> None:
    with pytest.raises(TypeError, match="model.layers"):
        apply_compile(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="compile_blocks must be a bool"):
        parallelize(_model(), compile_blocks="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nn.ModuleList"):
        parallelize(torch.nn.Linear(2, 2), checkpoint="all")
    # Checkpoint first, then compile (once): the compiled code holds a block's checkpoint.
    model = apply_compile(apply_checkpointing(_model(), "first:1+selective:1"))
    assert model.layers.compiled
    with pytest.raises(TypeError, match="already compiled"):
        apply_compile(model)
    with pytest.raises(TypeError, match="have their forward replaced"):
        apply_checkpointing(apply_compile(_model()), "all")
