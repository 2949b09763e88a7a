"""FusedAdamW against torch.optim.AdamW: updates, state, state_dict round trips, errors.

CPU tests run the kernel through the Triton interpreter in float32 (conftest.py sets TRITON_INTERPRET);
the interpreter rounds float32 -> bfloat16 toward zero, so bfloat16 parameters are checked on the GPU only.
"""

from __future__ import annotations

import pytest
import torch
from cs336_kernels.ops.fused_adamw import FusedAdamW

# The interpreter turns the kernel's size-1 loop bounds into ints the way NumPy 1.25 deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# float32 against torch's float32 AdamW: the two differ only in rounding order (about 1 ulp per step).
FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}
# bfloat16 parameters after one step from equal values: one bfloat16 ulp (at most 2**-7 relative), where the two
# float32 results fall on opposite sides of a rounding boundary.
BF16_PARAM_TOL = {"rtol": 2**-7, "atol": 1e-6}

# Odd sizes: a single element, a partial block, four full 2048-element blocks plus a tail, two full blocks + 3.
SHAPES = [(37,), (5, 13), (67, 131), (1,), (4099,)]
GPU_SHAPES = [(37,), (5, 13), (1031, 517), (1,), (4099,), (3, 65537)]
# Parameter index that gets a gradient only on even steps: its step count must lag the others.
SOMETIMES_NO_GRAD = 3
NUM_STEPS = 10


def _param_groups(params: list[torch.Tensor]) -> list[dict]:
    return [
        {"params": params[:2]},
        {"params": params[2:4], "lr": 3e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
        {"params": params[4:], "lr": 5e-3, "weight_decay": 0.0},
    ]


def _make_params(shapes: list[tuple[int, ...]], device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device) for s in shapes]


def _gradients(params: list[torch.Tensor], step: int, seed: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    grads = [torch.randn(p.shape, generator=gen).to(p.device) for p in params]
    if step % 2 == 1:
        grads[SOMETIMES_NO_GRAD] = None
    return grads


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range, seed: int = 0,
         grad_dtype: torch.dtype | None = None) -> None:
    """Steps with fresh gradients (rounded to grad_dtype); group 1's lr drops at step 5, as a scheduler would."""
    for step in steps:
        for p, g in zip(params, _gradients(params, step, seed), strict=True):
            p.grad = None if g is None else g.to(grad_dtype or p.dtype).to(p.dtype)
        if step == 5:
            opt.param_groups[1]["lr"] = 1e-2
        opt.step()


def _assert_matches(ours: FusedAdamW, ours_params, ref: torch.optim.Optimizer, ref_params) -> None:
    for p, q in zip(ours_params, ref_params, strict=True):
        torch.testing.assert_close(p, q, **FP32_TOL)
        s, r = ours.state[p], ref.state[q]
        assert s["step"].item() == r["step"].item()
        torch.testing.assert_close(s["exp_avg"], r["exp_avg"], **FP32_TOL)
        torch.testing.assert_close(s["exp_avg_sq"], r["exp_avg_sq"], **FP32_TOL)


def _clones(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def _check_against_torch(device: str, shapes: list[tuple[int, ...]], elements_per_program: int) -> None:
    params = _make_params(shapes, device, seed=1)
    ref_params = _clones(params)
    ours = FusedAdamW(_param_groups(params), lr=1e-2, elements_per_program=elements_per_program)
    ref = torch.optim.AdamW(_param_groups(ref_params), lr=1e-2, foreach=False)
    _run(ours, params, range(NUM_STEPS))
    _run(ref, ref_params, range(NUM_STEPS))
    _assert_matches(ours, params, ref, ref_params)
    assert ours.state[params[SOMETIMES_NO_GRAD]]["step"].item() == NUM_STEPS // 2


@pytest.mark.interpreter
@pytest.mark.parametrize("elements_per_program", [pytest.param(2048, marks=pytest.mark.slow), 32768])
def test_matches_torch_adamw_over_ten_steps(elements_per_program):
    # 2048: one block per program, so the larger tensors span several programs.
    _check_against_torch("cpu", SHAPES, elements_per_program)


@pytest.mark.interpreter
def test_state_dict_round_trip_mid_run():
    params = _make_params(SHAPES, "cpu", seed=2)
    ref_params = _clones(params)
    ref = torch.optim.AdamW(_param_groups(ref_params), lr=1e-2, foreach=False)
    _run(ref, ref_params, range(NUM_STEPS), seed=2)

    first = FusedAdamW(_param_groups(params), lr=1e-2)
    _run(first, params, range(5), seed=2)
    saved = first.state_dict()
    for state in saved["state"].values():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert isinstance(state["step"], torch.Tensor) and state["step"].dtype == torch.float32
        assert state["exp_avg"].dtype == torch.float32

    # Our state continues in a fresh FusedAdamW ...
    resumed_params = _clones(params)
    resumed = FusedAdamW(_param_groups(resumed_params), lr=1e-2)
    resumed.load_state_dict(saved)
    _run(resumed, resumed_params, range(5, NUM_STEPS), seed=2)
    _assert_matches(resumed, resumed_params, ref, ref_params)

    # ... and in torch.optim.AdamW, which reads the same layout.
    torch_params = _clones(params)
    torch_resumed = torch.optim.AdamW(_param_groups(torch_params), lr=1e-2, foreach=False)
    torch_resumed.load_state_dict(saved)
    _run(torch_resumed, torch_params, range(5, NUM_STEPS), seed=2)
    for p, q in zip(torch_params, ref_params, strict=True):
        torch.testing.assert_close(p, q, **FP32_TOL)


@pytest.mark.interpreter
def test_loads_torch_adamw_state():
    params = _make_params(SHAPES, "cpu", seed=3)
    ref_params = _clones(params)
    ref = torch.optim.AdamW(_param_groups(ref_params), lr=1e-2, foreach=False)
    _run(ref, ref_params, range(5), seed=3)
    saved = ref.state_dict()
    ours_params = _clones(ref_params)
    ours = FusedAdamW(_param_groups(ours_params), lr=1e-2)
    ours.load_state_dict(saved)
    _run(ref, ref_params, range(5, NUM_STEPS), seed=3)
    _run(ours, ours_params, range(5, NUM_STEPS), seed=3)
    _assert_matches(ours, ours_params, ref, ref_params)


@pytest.mark.interpreter
def test_unaligned_views_of_one_buffer():
    """Parameters at odd element offsets of one storage take the kernel's unvectorized path."""
    flat = torch.randn(9000)
    params = [flat[1:38], flat[41:4140].view(1, 4099), flat[4143:4208].view(5, 13), flat[8999:]]
    ref_params = _clones(params)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.2}]
    ours = FusedAdamW(groups(params), lr=1e-2)
    ref = torch.optim.AdamW(groups(ref_params), lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for p, q in zip(params, ref_params, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    _assert_matches(ours, params, ref, ref_params)


@pytest.mark.interpreter
def test_untouched_neighbours_and_no_grad_params():
    flat = torch.randn(100)
    before = flat.clone()
    p = flat[10:47]
    q = torch.randn(7)
    opt = FusedAdamW([p, q], lr=1e-1)
    p.grad = torch.randn(37)
    opt.step()
    assert torch.equal(flat[:10], before[:10]) and torch.equal(flat[47:], before[47:])
    assert not torch.equal(flat[10:47], before[10:47])
    assert q not in opt.state


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"betas": (0.9,)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"elements_per_program": 3000}, "elements_per_program"),
    ],
)
def test_rejects_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedAdamW([torch.randn(3)], **kwargs)


@pytest.mark.interpreter
def test_rejects_bad_parameters_and_gradients():
    with pytest.raises(TypeError, match="complex"):
        FusedAdamW([torch.randn(4, dtype=torch.complex64)])
    with pytest.raises(ValueError, match="one device"):
        FusedAdamW([torch.randn(4), torch.empty(4, device="meta")])
    with pytest.raises(ValueError, match="contiguous"):
        FusedAdamW([torch.randn(4, 6).t()])

    p = torch.randn(5, 5)
    opt = FusedAdamW([p])
    p.grad = torch.randn(5, 5).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    p.grad_dtype = None  # torch refuses a float64 grad on a float32 tensor unless told otherwise
    p.grad = torch.randn(5, 5, dtype=torch.float64)
    with pytest.raises(TypeError, match="dtype"):
        opt.step()


@pytest.mark.gpu
@pytest.mark.parametrize("elements_per_program", [pytest.param(2048, marks=pytest.mark.slow), 32768])
def test_matches_torch_adamw_on_gpu(elements_per_program):
    _check_against_torch("cuda", GPU_SHAPES, elements_per_program)


@pytest.mark.gpu
def test_bf16_params_keep_fp32_state_on_gpu():
    """Reference: torch AdamW on float32 copies of our bfloat16 values, whose result is then rounded to bfloat16.

    The reference restarts from our parameters every step: a one-ulp difference in one step would otherwise be
    carried along as an absolute offset that is many ulps once the value shrinks. The moments depend only on
    the gradients and are compared after all steps.
    """
    params = [p.bfloat16() for p in _make_params(GPU_SHAPES, "cuda", seed=4)]
    ref_params = [p.float() for p in params]
    ours = FusedAdamW(_param_groups(params), lr=1e-2)
    ref = torch.optim.AdamW(_param_groups(ref_params), lr=1e-2, foreach=False)
    for step in range(NUM_STEPS):
        for p, q in zip(params, ref_params, strict=True):
            q.data.copy_(p.float())
        _run(ours, params, range(step, step + 1), seed=4)
        _run(ref, ref_params, range(step, step + 1), seed=4, grad_dtype=torch.bfloat16)
        for p, q in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p.float(), q.bfloat16().float(), **BF16_PARAM_TOL)
    for p, q in zip(params, ref_params, strict=True):
        assert p.dtype == torch.bfloat16
        assert ours.state[p]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(ours.state[p]["exp_avg"], ref.state[q]["exp_avg"], **FP32_TOL)
        torch.testing.assert_close(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], **FP32_TOL)
    # A state_dict of bfloat16 parameters reloads with float32 moments.
    reloaded = FusedAdamW(_param_groups([p.clone() for p in params]), lr=1e-2)
    reloaded.load_state_dict(ours.state_dict())
    assert all(s["exp_avg_sq"].dtype == torch.float32 for s in reloaded.state.values())
