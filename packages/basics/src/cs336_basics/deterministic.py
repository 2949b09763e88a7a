"""Batch-invariant ``Linear``, ``Embedding`` and ``RMSNorm`` for deterministic mode.

Under ``torch.use_deterministic_algorithms(True)`` the three layers of :mod:`cs336_basics.model` call
:func:`linear`, :func:`embedding` and :func:`rms_norm` instead of their one-kernel forms, so that data-parallel
training (cs336_comms DDP, cs336_sharding ZeRO-1 and FSDP) leaves fp32 parameters bit-identical to one
process training on the whole batch, whenever the global batch is split into equal contiguous rank shards
and the number of ranks is a power of two. Two rules give that:

1. Batch invariance. Every kernel sees one batch element (one index of the leading dimension) at a time,
   with its operands contiguous at 64-byte-aligned addresses. BLAS and reduction kernels choose their
   blocking, and with it their order of summation, from the shapes and the alignment of their operands
   (MKL and cuBLAS both give rows of ``x @ W.T`` other bits when the matrix has fewer rows, MKL also when
   ``x`` or ``W`` is not 16-byte aligned; a CUDA row sum splits each row over more lanes when there are fewer
   than 16 rows), so per-example kernels on aligned copies compute each example's activations and gradients
   the same way wherever the example sits and however many examples share its batch.
2. Tree reduction. A weight's gradient is the sum of the examples' contributions (a matmul over the
   example's rows, an index-put of its tokens, a sum over its positions), added as a balanced pairwise tree
   split at midpoints, ``[lo, hi) -> [lo, mid) + [mid, hi)`` with ``mid = lo + (hi - lo) // 2``. With
   ``W * m`` examples in ``W`` contiguous shards of ``m`` (``W`` a power of two, any ``m``), the top
   ``log2 W`` levels of the whole batch's tree split exactly at shard boundaries, so each rank's local
   gradient is a subtree, and :mod:`cs336_comms.reduce` adds the ranks' gradients in the same tree order.

Scaling is exact too: a rank's loss is the mean over its ``m`` examples, so every gradient in its backward
is ``W`` times the whole-batch one (the backward is linear in the loss gradient, and multiplying by a power
of two commutes with rounding), and dividing the sum over ranks by ``W`` gives the whole batch's bits.

Cost, paid only in deterministic mode: ``B`` kernels where one sufficed (per example, forward and backward),
copies of operands that are not aligned, a copy to stack the per-example outputs, and up to
``ceil(log2 B) + 1`` partial weight gradients alive while a tree is summed (for the embedding each is a dense
``(vocab, d_model)`` table). Partial sums are kept in at least fp32. Outside deterministic mode nothing here
runs.

Limits. A weight used more than once in one forward (tied weights, a layer applied twice) gets the sum of
its uses' trees, which DDP then reduces over ranks: a different order from the whole batch's, so not
bit-identical under DDP (FSDP reduce-scatters each use on its own and stays exact). ``cross_entropy`` also
takes one example at a time in deterministic mode; everything else between the layers must be batch invariant
by itself. CUDA elementwise kernels are, and row reductions over at least 16 rows (attention's softmax over
``batch * heads * seq`` rows). CPU elementwise kernels compute a tensor's last ``numel % 16`` elements (AVX2)
in scalar code, and ``torch.sigmoid``'s scalar code rounds differently from its vector code, so SwiGLU is batch
invariant on CPU only when ``seq * d_ff`` is a multiple of 16. On CPU the full-batch run must use as many
threads as the ranks: MKL's small matmuls round differently with another thread count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Fresh allocations are aligned to at least this on CPU and CUDA; MKL picks other kernels below 16 bytes.
ALIGNMENT_BYTES = 64


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is contiguous and 64-byte aligned, else a contiguous (freshly allocated, aligned) copy."""
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def tree_sum(leaf: Callable[[int], torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """``leaf(lo) + ... + leaf(hi - 1)`` added as a balanced pairwise tree split at midpoints.

    Leaves are computed in increasing order, at most ``ceil(log2(hi - lo)) + 1`` partial sums are alive at once,
    and each ``leaf(i)`` must return a fresh tensor (partial sums are accumulated into it in place).
    """
    if hi - lo == 1:
        return leaf(lo)
    mid = lo + (hi - lo) // 2
    total = tree_sum(leaf, lo, mid)
    total += tree_sum(leaf, mid, hi)
    return total


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        w = _aligned(weight)
        return torch.stack([_aligned(x[b]) @ w.T for b in range(x.shape[0])])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        # The forward computed in grad's dtype (a lower one under autocast): so does the backward.
        grads = [_aligned(grad[b]) for b in range(grad.shape[0])]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            w = _aligned(weight.to(grad.dtype))
            grad_x = torch.stack([g @ w for g in grads])
        if ctx.needs_input_grad[1]:
            d_out, d_in = weight.shape
            acc = _accumulation_dtype(grad.dtype)

            def leaf(b: int) -> torch.Tensor:
                x_b = _aligned(x[b].to(grad.dtype)).reshape(-1, d_in)
                return (grads[b].reshape(-1, d_out).T @ x_b).to(acc)

            grad_w = tree_sum(leaf, 0, len(grads))
        return grad_x, grad_w


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(token_ids)
        ctx.weight_shape = weight.shape
        return weight[token_ids]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor | None]:
        if not ctx.needs_input_grad[1]:
            return None, None
        (token_ids,) = ctx.saved_tensors
        vocab_size, d_model = ctx.weight_shape
        acc = _accumulation_dtype(grad.dtype)

        def leaf(b: int) -> torch.Tensor:
            table = torch.zeros(vocab_size, d_model, dtype=acc, device=grad.device)
            rows = grad[b].reshape(-1, d_model).to(acc)
            return table.index_put_((token_ids[b].reshape(-1),), rows, accumulate=True)

        return None, tree_sum(leaf, 0, token_ids.shape[0])


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def _normalize(x_b: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One example's ``(x * rms, rms)``, ``rms = 1 / sqrt(mean(x^2) + eps)`` over the last dimension, in at
        least fp32."""
        xf = _aligned(x_b).to(_accumulation_dtype(x_b.dtype))
        rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        return xf * rms, rms

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return torch.stack([(_RMSNorm._normalize(x[b], eps)[0] * weight).to(x.dtype) for b in range(x.shape[0])])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        d = weight.shape[0]
        grad_x: list[torch.Tensor] = []

        def leaf(b: int) -> torch.Tensor:
            # y = xhat * w with xhat = x * rms: dw = sum(g * xhat), dx = rms * (u - xhat * mean(u * xhat)), u = g * w.
            xhat, rms = _RMSNorm._normalize(x[b], ctx.eps)
            g = _aligned(grad[b]).to(xhat.dtype)
            if ctx.needs_input_grad[0]:
                u = g * weight
                grad_x.append((rms * (u - xhat * (u * xhat).mean(dim=-1, keepdim=True))).to(x.dtype))
            return (g * xhat).reshape(-1, d).sum(dim=0)

        grad_w = tree_sum(leaf, 0, x.shape[0])
        return (torch.stack(grad_x) if grad_x else None), (grad_w if ctx.needs_input_grad[1] else None), None


def _check_batched(name: str, t: torch.Tensor, min_dim: int) -> None:
    if t.dim() < min_dim or t.shape[0] == 0:
        raise ValueError(f"{name} needs a non-empty leading batch dimension and at least {min_dim} dims, "
                         f"got shape {tuple(t.shape)}")


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` (batch, ..., d_in) and ``weight`` (d_out, d_in), batch invariant (see above)."""
    _check_batched("linear", x, 2)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear needs x (..., d_in) and weight (d_out, d_in), got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    return _Linear.apply(x, weight)


def embedding(token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[token_ids]`` for ids (batch, ...) and ``weight`` (vocab, d_model); batch-invariant backward."""
    _check_batched("embedding", token_ids, 1)
    if token_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"token ids must be int32 or int64, got {token_ids.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"embedding needs a (vocab, d_model) weight, got shape {tuple(weight.shape)}")
    return _Embedding.apply(token_ids, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (batch, ..., d) in at least fp32, returned in ``x``'s dtype."""
    _check_batched("rms_norm", x, 2)
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm needs x (..., d) and weight (d,), got {tuple(x.shape)} and {tuple(weight.shape)}")
    return _RMSNorm.apply(x, weight, eps)
