"""fused_linear_cross_entropy against F.linear + F.cross_entropy: loss, both gradients, errors, memory.

CPU tests run the Triton kernel through the interpreter (conftest.py) and compare in float64 and float32 with
a float64 reference. GPU tests check bfloat16, including the leaderboard shape (32,768 tokens, d_model 4,096,
vocab 151,936) against a float32 reference computed chunk by chunk.
"""

from __future__ import annotations

import pytest
import torch
from cs336_kernels.nn import FusedLinearCrossEntropyLoss
from cs336_kernels.ops.fused_linear_cross_entropy import (
    chunk_rows,
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
    scale_inplace,
)

# Relative error ||out - ref|| / ||ref|| allowed, by input dtype (the reference is float64 or float32).
# The interpreter turns the kernel's size-1 loop bounds into ints the way NumPy 1.25 deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

REL_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}
# The loss is accumulated in fp32 whatever the input dtype: against an fp32 reference of bf16 inputs only the
# bf16 rounding of the logits moves it, a few 1e-7 relative over 32,768 tokens (a bf16 loss is off by ~1e-3).
BF16_LOSS_REL_TOL = 1e-5
# Memory above inputs and gradients beyond the chunk buffer: cuBLAS workspaces, targets mask, loss vector.
MEMORY_SLACK_BYTES = 2**27
IGNORE = -100


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def _inputs(lead: tuple[int, ...], d: int, vocab: int, dtype: torch.dtype, device: str, seed: int,
            ignore_every: int = 5):
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(*lead, d, generator=gen, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, d, generator=gen, device=device) / d**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, lead, generator=gen, device=device)
    targets.view(-1)[::ignore_every] = IGNORE
    return hidden, weight, targets


def _loss_and_grads(fn, hidden, weight, targets, reduction, upstream=None, **kwargs):
    loss = fn(hidden, weight, targets, reduction, IGNORE, **kwargs)
    (loss if upstream is None else loss * upstream).sum().backward()
    grads = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    return loss.detach(), *grads


def _check_against_reference(lead, d, vocab, dtype, reduction, device="cpu", seed=0, chunk_size=None, **options):
    hidden, weight, targets = _inputs(lead, d, vocab, dtype, device, seed)
    ref_dtype = torch.float64 if device == "cpu" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    upstream = torch.randn(lead, generator=gen, device=device).to(dtype) if reduction == "none" else None
    ours = _loss_and_grads(fused_linear_cross_entropy, hidden, weight, targets, reduction, upstream,
                           chunk_size=chunk_size, **options)
    h_ref = hidden.detach().to(ref_dtype).requires_grad_()
    w_ref = weight.detach().to(ref_dtype).requires_grad_()
    up_ref = None if upstream is None else upstream.to(ref_dtype)
    ref = _loss_and_grads(linear_cross_entropy_reference, h_ref, w_ref, targets, reduction, up_ref, **options)
    assert ours[0].shape == ref[0].shape and ours[0].dtype == (torch.float64 if dtype == torch.float64 else
                                                                torch.float32)
    for name, out, expected in zip(("loss", "grad_hidden", "grad_weight"), ours, ref, strict=True):
        assert out.shape == expected.shape, name
        assert _rel_err(out, expected) < REL_TOL[dtype], (name, _rel_err(out, expected))


@pytest.mark.interpreter
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [None, 16])
def test_matches_reference_float64(reduction, chunk_size):
    # 2 x 19 tokens in chunks of 16 leave a ragged last chunk; vocab 1003 is not a multiple of the block.
    _check_against_reference((2, 19), 23, 1003, torch.float64, reduction, chunk_size=chunk_size)


@pytest.mark.interpreter
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_matches_reference_float32_large_vocab(reduction):
    # vocab above the 8192-column tile: the online logsumexp spans several tiles.
    _check_against_reference((29,), 17, 9001, torch.float32, reduction, chunk_size=8)


# The options: label smoothing, PaLM's z-loss and Gemma-2's logit softcap, alone and together. The kernel reads them
# as fp32 scalars, so the float64 checks take values fp32 holds exactly.
OPTIONS = {"smoothing": {"label_smoothing": 0.125}, "z_loss": {"z_loss": 2**-7}, "softcap": {"softcap": 3.0},
           "all": {"label_smoothing": 0.25, "z_loss": 2**-8, "softcap": 2.0}}


@pytest.mark.interpreter
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_match_reference_float64(option, reduction):
    _check_against_reference((2, 19), 23, 1003, torch.float64, reduction, chunk_size=16, seed=11, **OPTIONS[option])


@pytest.mark.interpreter
def test_options_match_reference_float32_large_vocab():
    # Several 8192-column tiles: the logit sum and the capped logits span tiles; logits of a few units, so the cap
    # at 2 saturates some of them.
    _check_against_reference((9,), 17, 9001, torch.float32, "sum", chunk_size=4, seed=12, **OPTIONS["all"])


@pytest.mark.interpreter
def test_options_reference_is_the_formulas():
    # The reference against the formulas written out: PyTorch's label smoothing, logsumexp^2 and tanh cap.
    hidden, weight, targets = _inputs((11,), 6, 29, torch.float64, "cpu", seed=13)
    logits = 2.0 * torch.tanh(hidden @ weight.T / 2.0)
    lse = torch.logsumexp(logits, dim=-1)
    kept = targets != IGNORE
    target_logit = logits.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    per_token = (lse - 0.75 * target_logit - 0.25 * logits.mean(-1) + 2**-8 * lse**2) * kept
    expected = per_token.sum() / kept.sum()
    got = linear_cross_entropy_reference(hidden, weight, targets, "mean", IGNORE, **OPTIONS["all"])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize(("tokens", "vocab", "expected"), [
    (32768, 151936, 2048),  # the leaderboard shape: 16 chunks of 2,048 (0.58 GiB of bf16 logits)
    (35000, 151936, 2176),  # 17 chunks; the last holds the remaining 184 tokens
    (100, 151936, 100),  # one chunk of every token
    (5, 2**30, 1),  # a budget below 128 rows: no rounding
    (0, 151936, 1),
])
def test_chunk_rows_fit_the_budget(tokens, vocab, expected):
    rows = chunk_rows(tokens, vocab, 2, None)
    assert rows == expected
    assert rows * vocab * 2 <= 5 * 2**27 or rows == 1
    assert chunk_rows(tokens, vocab, 2, 7) == max(1, min(7, tokens))


@pytest.mark.interpreter
def test_loss_is_float32_for_half_inputs():
    # fp16 through the interpreter: the logits are rounded to fp16 (the chunk buffer), but the per-token losses
    # and their mean stay fp32, so the loss is the exact cross-entropy of those rounded logits to fp32 precision;
    # rounding it to fp16 would move it by 3e-5 to 3e-4 relative on these inputs.
    hidden, weight, targets = _inputs((37,), 16, 101, torch.float16, "cpu", seed=8)
    loss = fused_linear_cross_entropy(hidden, weight, targets)
    rounded_logits = (hidden.float() @ weight.float().T).half().double()
    expected = torch.nn.functional.cross_entropy(rounded_logits, targets, ignore_index=IGNORE)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - expected.item()) / expected.item() < 1e-6
    loss.backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float16


@pytest.mark.interpreter
def test_single_token_and_module_form():
    hidden, weight, targets = _inputs((1,), 8, 13, torch.float64, "cpu", seed=3, ignore_every=2)
    targets[0] = 4
    module = FusedLinearCrossEntropyLoss(reduction="sum", ignore_index=IGNORE)
    expected = linear_cross_entropy_reference(hidden, weight, targets, "sum", IGNORE)
    torch.testing.assert_close(module(hidden, weight, targets), expected, rtol=1e-12, atol=0)


@pytest.mark.interpreter
def test_all_targets_ignored_gives_nan_mean_and_zero_gradients():
    hidden, weight, targets = _inputs((6,), 8, 13, torch.float64, "cpu", seed=4)
    targets.fill_(IGNORE)
    loss = fused_linear_cross_entropy(hidden, weight, targets)
    assert torch.isnan(loss) and torch.isnan(linear_cross_entropy_reference(hidden, weight, targets))
    assert fused_linear_cross_entropy(hidden, weight, targets, "sum").item() == 0.0
    loss.backward()
    assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0


@pytest.mark.interpreter
def test_gradient_only_where_required_and_no_grad_mode():
    hidden, weight, targets = _inputs((11,), 8, 37, torch.float64, "cpu", seed=5)
    weight.requires_grad_(False)
    fused_linear_cross_entropy(hidden, weight, targets).backward()
    h_ref = hidden.detach().clone().requires_grad_()
    linear_cross_entropy_reference(h_ref, weight, targets).backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, h_ref.grad, rtol=1e-12, atol=1e-15)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, targets)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, linear_cross_entropy_reference(hidden, weight, targets).detach(),
                               rtol=1e-12, atol=0)


@pytest.mark.interpreter
def test_second_backward_raises():
    hidden, weight, targets = _inputs((5,), 8, 13, torch.float64, "cpu", seed=6)
    loss = fused_linear_cross_entropy(hidden, weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


@pytest.mark.interpreter
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_upstream_gradient_other_than_one(reduction):
    # The forward's gradients are scaled by grad_loss in the backward (skipped on the device when it is 1).
    hidden, weight, targets = _inputs((2, 9), 12, 101, torch.float64, "cpu", seed=7)
    loss = fused_linear_cross_entropy(hidden, weight, targets, reduction, IGNORE, chunk_size=5)
    (0.37 * loss).backward()
    h_ref = hidden.detach().clone().requires_grad_()
    w_ref = weight.detach().clone().requires_grad_()
    (0.37 * linear_cross_entropy_reference(h_ref, w_ref, targets, reduction, IGNORE)).backward()
    assert _rel_err(hidden.grad, h_ref.grad) < REL_TOL[torch.float64]
    assert _rel_err(weight.grad, w_ref.grad) < REL_TOL[torch.float64]


def _check_scale_inplace(dtype: torch.dtype, s: float, device: str) -> None:
    # The product in fp32 (float64) with s unrounded, rounded once, over more than one block.
    x = torch.randn(8192 + 77, dtype=torch.float64, device=device).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    s_tensor = torch.tensor(s, dtype=acc, device=device)
    expected = (x.to(acc) * s_tensor).to(dtype)
    scale_inplace(x, s_tensor)
    assert torch.equal(x, expected)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("s", [1.0, 0.37, -3.1])
def test_scale_inplace_is_the_fp32_product(dtype, s):
    # On a CPU this is also eager x.mul_(s); the interpreter does not round bf16 as a GPU does (GPU test below).
    _check_scale_inplace(dtype, s, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("s", [1.0, 0.37])
def test_scale_inplace_is_the_fp32_product_on_gpu(dtype, s):
    _check_scale_inplace(dtype, s, "cuda")


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"hidden": torch.randn(4, 7)}, ValueError, "d_model=8"),
        ({"weight": torch.randn(13)}, ValueError, "weight must be"),
        ({"targets": torch.zeros(5, dtype=torch.long)}, ValueError, "targets must have shape"),
        # The range check reads the targets: on CPU tensors only (a host sync on a GPU).
        pytest.param({"targets": torch.tensor([0, 1, 13, 2])}, ValueError, r"\[0, 13\)", marks=pytest.mark.interpreter),
        pytest.param({"targets": torch.tensor([0, -1, 3, 2])}, ValueError, r"\[0, 13\)", marks=pytest.mark.interpreter),
        ({"targets": torch.zeros(4)}, TypeError, "int64"),
        ({"weight": torch.randn(13, 8, dtype=torch.float64)}, TypeError, "dtype"),
        ({"reduction": "avg"}, ValueError, "reduction"),
        pytest.param({"chunk_size": 0}, ValueError, "chunk_size", marks=pytest.mark.interpreter),
    ],
)
def test_rejects_bad_inputs(change, error, message):
    args = {"hidden": torch.randn(4, 8), "weight": torch.randn(13, 8), "targets": torch.tensor([0, IGNORE, 12, 3]),
            "reduction": "mean", "chunk_size": None}
    args.update(change)
    with pytest.raises(error, match=message):
        fused_linear_cross_entropy(args["hidden"], args["weight"], args["targets"], args["reduction"], IGNORE,
                                   chunk_size=args["chunk_size"])


@pytest.mark.parametrize(("options", "message"), [
    ({"label_smoothing": 1.5}, r"label_smoothing must lie in \[0, 1\]"),
    ({"label_smoothing": -0.1}, "label_smoothing must be a finite non-negative float"),
    ({"z_loss": float("inf")}, "z_loss must be a finite non-negative float"),
    ({"softcap": -1.0}, "softcap must be a finite non-negative float"),
    ({"softcap": True}, "softcap must be a finite non-negative float"),
])
def test_rejects_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        fused_linear_cross_entropy(torch.randn(4, 8), torch.randn(13, 8), torch.tensor([0, IGNORE, 12, 3]),
                                   **options)


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_reference_bf16_on_gpu(reduction):
    _check_against_reference((3, 1001), 257, 32003, torch.bfloat16, reduction, device="cuda", chunk_size=512)


@pytest.mark.gpu
@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_match_reference_bf16_on_gpu(option):
    _check_against_reference((3, 1001), 257, 32003, torch.bfloat16, "mean", device="cuda", chunk_size=512,
                             **OPTIONS[option])


def _chunked_fp32_reference(hidden, weight, targets, chunk):
    """Mean loss and gradients in float32 from the plain reference applied to one chunk of tokens at a time."""
    w = weight.detach().float().requires_grad_()
    grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start:start + chunk].detach().float().requires_grad_()
        loss = linear_cross_entropy_reference(h, w, targets[start:start + chunk], "sum", IGNORE)
        loss.backward()
        grad_hidden[start:start + chunk] = h.grad
        total += loss.detach()
    count = (targets != IGNORE).sum()
    return total / count, grad_hidden / count, w.grad / count


@pytest.mark.gpu
@pytest.mark.gpu_exclusive
def test_leaderboard_shape_bf16_on_gpu():
    tokens, d, vocab = 32768, 4096, 151936
    hidden, weight, targets = _inputs((tokens,), d, vocab, torch.bfloat16, "cuda", seed=7, ignore_every=97)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fused_linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    torch.cuda.synchronize()
    grads_bytes = hidden.grad.nbytes + weight.grad.nbytes
    extra = torch.cuda.max_memory_allocated() - base - grads_bytes
    buffer = chunk_rows(tokens, vocab, 2, None) * vocab * 2  # the one chunk of logits the docstring accounts for
    assert extra < buffer + MEMORY_SLACK_BYTES, f"{extra / 2**30:.3f} GiB above inputs and gradients"
    assert loss.dtype == torch.float32
    ours = loss.detach(), hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    ref = _chunked_fp32_reference(hidden, weight, targets, chunk=4096)
    for name, out, expected in zip(("loss", "grad_hidden", "grad_weight"), ours, ref, strict=True):
        assert torch.isfinite(out).all(), name
        tol = BF16_LOSS_REL_TOL if name == "loss" else REL_TOL[torch.bfloat16]
        assert _rel_err(out, expected) < tol, (name, _rel_err(out, expected))
