"""Linear layer + cross-entropy without materializing the (tokens x vocab) logits.

For an LM head, ``F.cross_entropy(hidden @ weight.T, targets)`` keeps the full logits, its softmax and their
gradient alive: at 32,768 tokens and a 151,936-word vocabulary that is tens of GiB. Here tokens are processed in
equal chunks whose logits fit a fixed budget (640 MiB). For each chunk:

    logits = h_chunk @ weight.T                        (torch matmul, input dtype, fp32 accumulation)
    Triton kernel, one program per row, in place:      max and sum of exp in fp32, loss = logsumexp - logit[target],
                                                       logits <- scale * (softmax - onehot(target))
    grad_hidden[chunk] = dlogits @ weight;  grad_weight += dlogits.T @ h_chunk

so the gradients exist when the forward returns and the backward only multiplies them by grad_output
(the approach of Liger-Kernel's fused linear cross-entropy). With reduction="none" the per-token weights of
the backward are unknown in the forward, so the forward only computes the losses and the backward recomputes the
logits chunk by chunk (one matmul more). The loss is accumulated and returned in fp32 (float64 for float64
inputs): per-token losses in fp32 from the kernel, summed in fp32.

Memory above the inputs and their gradients, at the leaderboard shape (N = 32,768 tokens, d = 4,096,
V = 151,936, bf16; 16 chunks of 2,048 tokens):

    chunk buffer     rows x V x 2 B = 2,048 x 151,936 x 2 = 0.58 GiB   logits, then dlogits in place
    grad buffers     none extra: grad_hidden (N x d, 0.25 GiB) and grad_weight (V x d, 1.16 GiB) are written
                     in place chunk by chunk and handed to autograd as the gradients themselves (no copy)
    fp32 accumulators the per-token losses, N x 4 B = 128 KiB, and the scalar loss; grad_weight is accumulated
                     in the weight dtype across chunks (an fp32 copy would cost V x d x 4 = 2.32 GiB): each
                     chunk's product accumulates in fp32 inside the GEMM and is rounded once when it is added

so about 0.58 GiB. The LM head runs at the end of the forward, when every saved activation is alive, so these
bytes add to a training step's peak; 2,048-token chunks keep the GEMMs' inner dimension large.

    loss = fused_linear_cross_entropy(hidden, lm_head.weight, targets)  # hidden (N, d), weight (V, d)
    loss.backward()

Three options change the per-token loss, each off by default and a constexpr of the kernel when on (the default
path compiles as before). With logits x (capped: ``x = softcap * tanh(x / softcap)``, Gemma-2's final logit cap),
lse = logsumexp(x), target t and vocabulary V:

    loss = lse - (1 - label_smoothing) * x[t] - label_smoothing / V * sum(x) + z_loss * lse^2
    dloss/dx[j] = softmax(x)[j] * (1 + 2 * z_loss * lse) - (1 - label_smoothing) * [j == t] - label_smoothing / V

(times ``1 - tanh^2`` for the cap): ``F.cross_entropy(..., label_smoothing=)``'s loss plus PaLM's auxiliary z-loss
(Liger-Kernel's ``lse_square_scale``), reduced like the cross-entropy (the mean over tokens not ignored). The kernel
reads the three as fp32 scalars, also for float64 inputs.

``linear_cross_entropy_reference`` is the plain PyTorch computation that tests and benchmarks compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch._subclasses.functional_tensor import FunctionalTensor

from cs336_kernels.interpreter import check_device
from cs336_kernels.ops._common import device_context

# Bytes of one chunk of logits: bounds the memory above inputs and gradients (2,048 x 151,936 bf16 fits).
CHUNK_BYTES = 5 * 2**27
# Chunk rows are a multiple of this when the budget allows (whole GEMM tiles).
_ROW_MULTIPLE = 128
_MAX_BLOCK_V = 8192
REDUCTIONS = ("mean", "sum", "none")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@triton.jit
def _tanh(x):
    # From one exp2, exact at both ends (exp2 overflowing to inf gives 1, underflowing to 0 gives -1) and in the
    # interpreter, which has no libdevice.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)


@triton.jit
def _load_logits(X, offs, V, softcap, ACC: tl.constexpr, SOFTCAP: tl.constexpr):
    """A tile of logits in ACC, capped when SOFTCAP, -inf past the row's end."""
    x = tl.load(X + offs, mask=offs < V, other=float("-inf")).to(ACC)
    if SOFTCAP:
        x = tl.where(offs < V, softcap * _tanh(x / softcap), float("-inf"))
    return x


@triton.jit
def _softmax_grad_kernel(
    LOGITS,  # (rows, V), in place: logits in, scale * dloss/dlogits out when WRITE_GRAD
    TARGETS,  # (rows,) integer
    LOSS,  # (rows,) float32 (float64 for float64 logits): the token's loss, 0 where ignored
    SCALE,  # gradient scale of each row, read at SCALE + row * scale_stride
    stride_row,
    scale_stride,
    V,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    WRITE_GRAD: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SMOOTH: tl.constexpr,  # label_smoothing > 0
    Z_LOSS: tl.constexpr,  # z_loss > 0
    SOFTCAP: tl.constexpr,  # softcap > 0
):
    row = tl.program_id(0).to(tl.int64)
    X = LOGITS + row * stride_row
    target = tl.load(TARGETS + row)
    cols = tl.arange(0, BLOCK_V)
    if target == ignore_index:
        tl.store(LOSS + row, tl.zeros((), ACC))
        if WRITE_GRAD:
            for start in range(0, V, BLOCK_V):
                tl.store(X + start + cols, tl.zeros((BLOCK_V,), X.dtype.element_ty), mask=start + cols < V)
    else:
        # Online logsumexp over the row, one tile at a time.
        row_max = tl.full((), float("-inf"), ACC)
        row_sum = tl.zeros((), ACC)
        logit_sum = tl.zeros((), ACC)
        for start in range(0, V, BLOCK_V):
            x = _load_logits(X, start + cols, V, softcap, ACC, SOFTCAP)
            new_max = tl.maximum(row_max, tl.max(x, axis=0))
            row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            row_max = new_max
            if SMOOTH:
                logit_sum += tl.sum(tl.where(start + cols < V, x, 0.0), axis=0)
        lse = row_max + tl.log(row_sum)
        target_logit = tl.load(X + target).to(ACC)
        if SOFTCAP:
            target_logit = softcap * _tanh(target_logit / softcap)
        target_weight = 1.0
        if SMOOTH:
            smoothing = tl.zeros((), ACC) + label_smoothing  # in ACC, so that smoothing / V is too
            target_weight = 1.0 - smoothing
        loss = lse - target_weight * target_logit
        if SMOOTH:
            loss -= smoothing / V * logit_sum
        if Z_LOSS:
            loss += z_loss * lse * lse
        tl.store(LOSS + row, loss)
        if WRITE_GRAD:
            scale = tl.load(SCALE + row * scale_stride).to(ACC)
            softmax_weight = 1.0
            if Z_LOSS:
                softmax_weight = 1.0 + 2.0 * z_loss * lse
            for start in range(0, V, BLOCK_V):
                offs = start + cols
                x = _load_logits(X, offs, V, softcap, ACC, SOFTCAP)
                grad = tl.exp(x - lse) * softmax_weight - tl.where(offs == target, target_weight, 0.0)
                if SMOOTH:
                    grad -= smoothing / V
                if SOFTCAP:
                    t = x / softcap
                    grad = grad * (1.0 - t * t)  # d(softcap * tanh(x / softcap)) / dx
                tl.store(X + offs, (grad * scale).to(X.dtype.element_ty), mask=offs < V)


@dataclass(frozen=True)
class LossOptions:
    """What changes the per-token loss (module docstring): all 0 is plain cross-entropy."""

    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float = 0.0


def softmax_grad_inplace(logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor, scale: torch.Tensor,
                         scale_stride: int, ignore_index: int, write_grad: bool,
                         options: LossOptions = LossOptions()) -> None:
    """The kernel over a contiguous (rows, V) chunk: per-row losses, and the logits turned into
    scale * dloss/dlogits when ``write_grad`` (row i's scale at ``scale[i * scale_stride]``); plain cross-entropy
    unless ``options`` say otherwise."""
    rows, vocab = logits.shape
    block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(vocab))
    acc = tl.float64 if logits.dtype == torch.float64 else tl.float32
    with device_context(logits):
        _softmax_grad_kernel[(rows,)](
            logits, targets, losses, scale, logits.stride(0), scale_stride, vocab, ignore_index,
            options.label_smoothing, options.z_loss, options.softcap,
            WRITE_GRAD=write_grad, ACC=acc, BLOCK_V=block_v, SMOOTH=options.label_smoothing > 0,
            Z_LOSS=options.z_loss > 0, SOFTCAP=options.softcap > 0, num_warps=8 if block_v >= 4096 else 4,
        )


@triton.jit
def _scale_inplace_kernel(X, S, n, ACC: tl.constexpr, BLOCK: tl.constexpr):
    # A product with exactly 1 changes no value, so for loss.backward() (grad_loss 1) no byte moves.
    s = tl.load(S).to(ACC)
    if s != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(X + offs, mask=mask)
        tl.store(X + offs, (x.to(ACC) * s).to(X.dtype.element_ty), mask=mask)


@torch.library.custom_op("cs336::scale_inplace", mutates_args=("x",))
def scale_inplace(x: torch.Tensor, s: torch.Tensor) -> None:
    """``x.mul_(s)`` for a contiguous x and a 0-d fp32 (float64) s: the product in fp32 (float64 for float64 x)
    with s unrounded, as Inductor and eager PyTorch on a CPU compute it (eager CUDA rounds s to x's dtype first),
    reading s on the device so that s == 1 costs only the launch."""
    n = x.numel()
    if n:
        block = 8192
        acc = tl.float64 if x.dtype == torch.float64 else tl.float32
        with device_context(x):
            _scale_inplace_kernel[(triton.cdiv(n, block),)](x, s, n, ACC=acc, BLOCK=block, num_warps=8)


def chunk_rows(num_tokens: int, vocab: int, element_size: int, chunk_size: int | None) -> int:
    """Tokens per chunk: the fewest equal chunks within the budget, rounded up to a multiple of 128 rows (which
    stays within the budget, itself rounded down to a multiple of 128 first)."""
    if chunk_size is not None:
        return max(1, min(chunk_size, num_tokens))
    budget_rows = max(1, CHUNK_BYTES // (vocab * element_size))
    multiple = _ROW_MULTIPLE if budget_rows >= _ROW_MULTIPLE else 1
    max_rows = budget_rows // multiple * multiple
    num_chunks = max(1, -(-num_tokens // max_rows))
    rows = -(-num_tokens // num_chunks)
    return max(1, min(-(-rows // multiple) * multiple, num_tokens))


def _loss_and_grads(
    hidden: torch.Tensor,  # (N, d)
    weight: torch.Tensor,  # (V, d)
    targets: torch.Tensor,  # (N,)
    ignore_index: int,
    scale: torch.Tensor | None,
    scale_stride: int,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    chunk_size: int | None,
    options: LossOptions,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-token losses and, if asked, the gradients of sum_i scale_i * loss_i, chunk by chunk."""
    num_tokens, vocab = hidden.shape[0], weight.shape[0]
    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    losses = torch.empty(num_tokens, dtype=acc_dtype, device=hidden.device)
    write_grad = need_grad_hidden or need_grad_weight
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None
    grad_weight = None
    if need_grad_weight:
        # The first chunk's product is written, later ones added: no memset and one read of grad_weight fewer.
        grad_weight = torch.empty_like(weight) if num_tokens else torch.zeros_like(weight)
    if scale is None:
        scale = losses  # never read: the kernel only reads SCALE when it writes gradients
    rows = chunk_rows(num_tokens, vocab, hidden.element_size(), chunk_size)
    buffer = hidden.new_empty(rows, vocab) if num_tokens else None
    for start in range(0, num_tokens, rows):
        end = min(start + rows, num_tokens)
        h = hidden[start:end]  # (c, d)
        logits = buffer[: end - start]  # (c, V)
        torch.mm(h, weight.t(), out=logits)
        row_scale = scale[start:] if scale_stride else scale
        softmax_grad_inplace(logits, targets[start:end], losses[start:end], row_scale, scale_stride, ignore_index,
                             write_grad, options)
        if need_grad_hidden:
            torch.mm(logits, weight, out=grad_hidden[start:end])
        if need_grad_weight:
            if start == 0:
                torch.mm(logits.t(), h, out=grad_weight)
            else:
                grad_weight.addmm_(logits.t(), h)
    return losses, grad_hidden, grad_weight


def _scale(reduction: str, targets: torch.Tensor, ignore_index: int, acc_dtype: torch.dtype) -> torch.Tensor:
    """The gradient scale of every token's loss: 1 / (tokens not ignored) for the mean, 1 for the sum."""
    if reduction == "mean":
        # 0/0 = nan when every target is ignored, as F.cross_entropy gives.
        return 1.0 / (targets != ignore_index).sum().to(acc_dtype)
    return torch.ones((), dtype=acc_dtype, device=targets.device)


def _acc_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


@torch.library.custom_op("cs336::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str,
                            ignore_index: int, chunk_size: int | None, need_grad_hidden: bool, need_grad_weight: bool,
                            label_smoothing: float = 0.0, z_loss: float = 0.0,
                            softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_hidden, grad_weight) for hidden (N, d), weight (V, d), targets (N,), as
    ``torch.ops.cs336.linear_cross_entropy``. For "mean" and "sum" the gradients of the loss are computed here,
    chunk by chunk, those not asked for coming back empty; for "none" both are empty (the backward recomputes)."""
    options = LossOptions(label_smoothing, z_loss, softcap)
    if reduction == "none":
        losses, _, _ = _loss_and_grads(hidden, weight, targets, ignore_index, None, 0, False, False, chunk_size,
                                       options)
        return losses, hidden.new_empty(0), weight.new_empty(0)
    scale = _scale(reduction, targets, ignore_index, _acc_dtype(hidden))
    losses, grad_hidden, grad_weight = _loss_and_grads(hidden, weight, targets, ignore_index, scale, 0,
                                                       need_grad_hidden, need_grad_weight, chunk_size, options)
    return (losses.sum() * scale, hidden.new_empty(0) if grad_hidden is None else grad_hidden,
            weight.new_empty(0) if grad_weight is None else grad_weight)


@linear_cross_entropy_op.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str, ignore_index: int,
      chunk_size: int | None, need_grad_hidden: bool, need_grad_weight: bool, label_smoothing: float = 0.0,
      z_loss: float = 0.0, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    loss = hidden.new_empty(targets.shape if reduction == "none" else (), dtype=_acc_dtype(hidden))
    in_forward = reduction != "none"
    grad_hidden = hidden.new_empty(hidden.shape if in_forward and need_grad_hidden else (0,))
    grad_weight = weight.new_empty(weight.shape if in_forward and need_grad_weight else (0,))
    return loss, grad_hidden, grad_weight


@torch.library.custom_op("cs336::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                     grad_losses: torch.Tensor, ignore_index: int, chunk_size: int | None,
                                     need_grad_hidden: bool, need_grad_weight: bool, label_smoothing: float = 0.0,
                                     z_loss: float = 0.0,
                                     softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``sum(grad_losses * losses)`` for reduction "none", recomputing the logits chunk by chunk
    (those not asked for come back empty), as ``torch.ops.cs336.linear_cross_entropy_backward``."""
    weights = grad_losses.reshape(-1)
    _, grad_hidden, grad_weight = _loss_and_grads(hidden, weight, targets, ignore_index, weights, weights.stride(0),
                                                  need_grad_hidden, need_grad_weight, chunk_size,
                                                  LossOptions(label_smoothing, z_loss, softcap))
    return (hidden.new_empty(0) if grad_hidden is None else grad_hidden,
            weight.new_empty(0) if grad_weight is None else grad_weight)


@linear_cross_entropy_backward_op.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad_losses: torch.Tensor,
      ignore_index: int, chunk_size: int | None, need_grad_hidden: bool, need_grad_weight: bool,
      label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return (hidden.new_empty(hidden.shape if need_grad_hidden else (0,)),
            weight.new_empty(weight.shape if need_grad_weight else (0,)))


def _setup(ctx, inputs: tuple, output: tuple) -> None:
    hidden, weight, targets, reduction, ignore_index, chunk_size, need_h, need_w, *options = inputs
    ctx.reduction, ctx.ignore_index, ctx.chunk_size, ctx.needs = reduction, ignore_index, chunk_size, (need_h, need_w)
    ctx.options = options  # label_smoothing, z_loss, softcap
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, targets)
    else:
        # Held as attributes, not saved tensors, so the backward can drop them before handing them to autograd:
        # a tensor with no other owner becomes the parameter's .grad without a copy.
        ctx.grads = (output[1], output[2])


def _backward(ctx, grad_loss: torch.Tensor, _grad_h: torch.Tensor, _grad_w: torch.Tensor):
    need_h, need_w = ctx.needs
    if ctx.reduction == "none":
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden, grad_weight = linear_cross_entropy_backward_op(hidden, weight, targets, grad_loss,
                                                                    ctx.ignore_index, ctx.chunk_size, need_h, need_w,
                                                                    *ctx.options)
    else:
        if ctx.grads is None:
            raise RuntimeError("fused_linear_cross_entropy computes its gradients in the forward and supports "
                               "one backward per forward (retain_graph=True cannot be used with it)")
        grads, ctx.grads = ctx.grads, None
        # Eagerly the forward's buffers are scaled in place and become the gradients, with no copy (1.4 GiB at
        # 32,768 tokens x a 151,936 x 4,096 bf16 head, at the moment the saved activations peak). Traced by
        # functionalization (torch.compile's AOTAutograd, opcheck), an op's outputs must not change, so the
        # product is a new tensor there.
        # Both paths multiply by the fp32 grad_loss unrounded, so eager and compiled gradients agree bit for bit.
        if isinstance(grad_loss, FunctionalTensor):
            grad_hidden, grad_weight = (torch.mul(g, grad_loss) for g in grads)
        else:
            for g in grads:
                scale_inplace(g, grad_loss)
            grad_hidden, grad_weight = grads
        del grads
    return (grad_hidden if need_h else None, grad_weight if need_w else None, *(None,) * (6 + len(ctx.options)))


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup)


class _LinearCrossEntropy(torch.autograd.Function):
    """The public function's node: the operator with its own autograd formula (:func:`_setup`, :func:`_backward`),
    applied by a plain ``autograd.Function``. Through the operator's generated node, autograd copied the gradients
    the backward returns into ``.grad`` on a GPU (1.4 GiB more at the leaderboard shape) instead of taking them;
    Dynamo traces this Function with the operator inside, so compiled code sees one op as before."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str,
                ignore_index: int, chunk_size: int | None, need_grad_hidden: bool, need_grad_weight: bool,
                label_smoothing: float, z_loss: float, softcap: float) -> torch.Tensor:
        inputs = (hidden, weight, targets, reduction, ignore_index, chunk_size, need_grad_hidden, need_grad_weight,
                  label_smoothing, z_loss, softcap)
        output = linear_cross_entropy_op(*inputs)
        _setup(ctx, inputs, output)
        return output[0]

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        return _backward(ctx, grad_loss, None, None)


def _check_options(label_smoothing: float, z_loss: float, softcap: float) -> None:
    for name, value in (("label_smoothing", label_smoothing), ("z_loss", z_loss), ("softcap", softcap)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite non-negative float, got {value!r}")
    if label_smoothing > 1:
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing!r}")


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str,
                  chunk_size: int | None) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be (vocab, d_model), got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden must be (..., d_model={weight.shape[1]}) to match weight "
                         f"{tuple(weight.shape)}, got shape {tuple(hidden.shape)}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1])} (hidden without its last dim), "
                         f"got {tuple(targets.shape)}")
    if hidden.dtype not in _FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must share a floating dtype (one of {_FLOAT_DTYPES}), got "
                        f"{hidden.dtype} and {weight.dtype}")
    if targets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"targets must be int64 or int32, got {targets.dtype}")
    if not hidden.device == weight.device == targets.device:
        raise ValueError(f"hidden, weight and targets must be on one device, got {hidden.device}, "
                         f"{weight.device}, {targets.device}")
    check_device(hidden.device, "fused_linear_cross_entropy")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    reduction: str = "mean",
    ignore_index: int = -100,
    *,
    chunk_size: int | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``targets``, as F.cross_entropy(F.linear(...)).

    Args:
        hidden: (..., d_model) activations.
        weight: (vocab, d_model) output projection, same dtype and device as hidden.
        targets: (...) class indices in [0, vocab), or ignore_index for tokens that do not count.
        reduction: "mean" over non-ignored tokens, "sum", or "none" (per-token losses, ignored ones 0).
        ignore_index: target value that contributes no loss and no gradient.
        chunk_size: tokens per chunk; default from a fixed logits-memory budget.
        label_smoothing: in [0, 1], as ``F.cross_entropy``'s.
        z_loss: adds ``z_loss * logsumexp(logits)^2`` to each token's loss (PaLM; Liger's ``lse_square_scale``).
        softcap: > 0 caps the logits at ``softcap * tanh(logits / softcap)`` before the loss (Gemma-2).

    Returns:
        The loss in fp32 (float64 for float64 inputs): a scalar, or shaped like targets for reduction="none".
    """
    _check_inputs(hidden, weight, targets, reduction, chunk_size)
    _check_options(label_smoothing, z_loss, softcap)
    vocab = weight.shape[0]
    flat_targets = targets.reshape(-1).contiguous()
    # The range check reads the targets: free on CPU, a host sync per call on a GPU, so there it is not made
    # (a target outside the vocabulary then gives a meaningless loss for its token, not an error), nor while
    # torch.compile traces (a value read from a tensor would break the graph).
    if flat_targets.device.type == "cpu" and not torch.compiler.is_compiling():
        out_of_range = ((flat_targets < 0) | (flat_targets >= vocab)) & (flat_targets != ignore_index)
        if out_of_range.any():
            bad = flat_targets[out_of_range]
            raise ValueError(f"targets must lie in [0, {vocab}) or equal ignore_index={ignore_index}; got "
                             f"{bad.numel()} outside, e.g. {bad[:5].tolist()}")
    grad_enabled = torch.is_grad_enabled()
    loss = _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, flat_targets, reduction,
                                     ignore_index, chunk_size, grad_enabled and hidden.requires_grad,
                                     grad_enabled and weight.requires_grad, float(label_smoothing), float(z_loss),
                                     float(softcap))
    return loss.reshape(targets.shape) if reduction == "none" else loss


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    reduction: str = "mean",
    ignore_index: int = -100,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Plain PyTorch: F.linear then F.cross_entropy, holding the full logits (the baseline and the oracle); the
    options as Gemma-2 caps its logits and PaLM adds its z-loss, reduced like the cross-entropy."""
    logits = F.linear(hidden, weight)  # (..., V)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits, flat_targets = logits.reshape(-1, weight.shape[0]), targets.reshape(-1).long()
    if not z_loss:
        loss = F.cross_entropy(logits, flat_targets, reduction=reduction, ignore_index=ignore_index,
                               label_smoothing=label_smoothing)
        return loss.reshape(targets.shape) if reduction == "none" else loss
    kept = flat_targets != ignore_index
    losses = F.cross_entropy(logits, flat_targets, reduction="none", ignore_index=ignore_index,
                             label_smoothing=label_smoothing)
    losses = losses + z_loss * torch.logsumexp(logits, dim=-1).square() * kept
    if reduction == "none":
        return losses.reshape(targets.shape)
    return losses.sum() / kept.sum() if reduction == "mean" else losses.sum()


