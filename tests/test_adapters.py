"""The CS336 adapter interface is wired to working implementations (one process; the multi-rank
behaviour is tested in each package's own suite)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import adapters


@pytest.fixture
def single_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("get", [
    # The PyTorch function's backward is torch.compile'd: tens of seconds on a CPU.
    pytest.param(adapters.get_flashattention_autograd_function_pytorch, marks=pytest.mark.slow),
    adapters.get_flashattention_autograd_function_triton,
])
@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_attention_adapters(get, is_causal):
    q, k, v = (torch.randn(2, 17, 16, requires_grad=True) for _ in range(3))
    out = get().apply(q, k, v, is_causal)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=is_causal)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))


def _train(model, opt, on_after_backward) -> None:
    for _ in range(3):
        ids = torch.randint(0, 11, (4, 3))
        loss = model(ids).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        on_after_backward(model, opt)
        opt.step()


def test_ddp_adapters_match_plain_training(single_rank_group):
    plain, wrapped = _model(), adapters.get_ddp(_model())
    torch.manual_seed(1)
    _train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), lambda m, o: None)
    torch.manual_seed(1)
    _train(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), adapters.ddp_on_after_backward)
    for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_fsdp_adapters_match_plain_training(single_rank_group):
    plain, wrapped = _model(), adapters.get_fsdp(_model())
    torch.manual_seed(1)
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=0.1), lambda m, o: None)
    torch.manual_seed(1)
    _train(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=0.1), adapters.fsdp_on_after_backward)
    full = adapters.fsdp_gather_full_params(wrapped)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p)


def test_sharded_optimizer_adapter_matches_wrapped_optimizer(single_rank_group):
    plain, sharded = _model(), _model()
    torch.manual_seed(1)
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=0.1), lambda m, o: None)
    torch.manual_seed(1)
    opt = adapters.get_sharded_optimizer(sharded.parameters(), torch.optim.AdamW, lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    _train(sharded, opt, lambda m, o: None)
    for p, q in zip(plain.parameters(), sharded.parameters(), strict=True):
        torch.testing.assert_close(p, q)
