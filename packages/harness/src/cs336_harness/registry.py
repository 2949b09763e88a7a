"""Every name the ``cs336`` command accepts for a piece of the training step, mapped once to its callable.

The command line and the tables speak in these names; Python callers pass the callables themselves
(:class:`cs336_harness.train_config.TrainConfig` takes a :class:`cs336_basics.model.BlockKernels` and an optimizer
factory), so a function of their own trains the same way as one named here.

- :data:`ATTENTIONS`: ``fn(q, k, v, is_causal) -> out`` over (batch, heads, seq, head_dim) tensors: ``eager`` (the
  model's own, scores materialised), ``annotated`` (the same math with NVTX and profiler ranges around scores,
  softmax and the final matmul), ``compiled`` (``torch.compile`` of the model's own), ``sdpa``
  (``torch.nn.functional.scaled_dot_product_attention``) and ``triton`` (``cs336_kernels.flash_attention`` as it runs
  by default: Triton, or the Gluon kernels on sm_90);
- :data:`GLUES`: the block's ``norm``, ``add_norm``, ``rotary`` and ``gate``: ``model`` (the model's own PyTorch
  code), ``triton`` (our kernels ``cs336_kernels.rms_norm``, ``add_rms_norm``, ``rope`` and ``silu_mul``: RMSNorm
  statistics in fp32 inside the kernel, the residual add folded into the second norm (bit for bit the add, the norm
  and autograd's sum of their gradients), RoPE on q and k in the projections' layout writing the layout the
  attention reads, the SwiGLU gate in one pass each way) and ``compiled`` (``torch.compile`` of the same PyTorch
  references the kernels are tested against);
- :data:`LOSSES`: the LM head's loss ``fn(hidden, weight, targets)``: ``standard`` (None: the model's logits, then
  cross-entropy), ``fused`` (``cs336_kernels.fused_linear_cross_entropy``, which never materialises the logits) and
  ``chunked`` (:func:`chunked_cross_entropy`, PyTorch's pieces a chunk of tokens at a time);
- :data:`OPTIMIZERS`: factories ``fn(params, lr, weight_decay) -> Optimizer``: ``adamw`` (ours,
  ``cs336_basics.optimizer.AdamW``), ``torch-adamw`` (``torch.optim.AdamW``, fused on CUDA) and ``fused-adamw``
  (our Triton ``cs336_kernels.FusedAdamW``);
- checkpoint policies: those of :func:`cs336_sharding.checkpointing.parse_policy` (:data:`CHECKPOINT_KINDS`), and
  :data:`BUDGET`, the policy that recomputes least within a memory cap (:mod:`cs336_harness.memory_plan`).

Entries that need ``cs336_kernels`` import it when they are asked for: on a CPU the Triton interpreter must be
chosen before the kernels load.

A piece of one's own gets a name with :func:`register_attention`, :func:`register_glue`, :func:`register_loss` or
:func:`register_optimizer`, after which every command and config that names pieces takes it. Register at the top
level of the module that runs the command (``cs336_harness.cli.main([...])``): ranks that a command spawns import
that module again, and so know the name too::

    registry.register_attention("mine", my_attention)      # fn(q, k, v, is_causal) -> out
    cli.main(["bench", "--attention", "mine"])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from cs336_basics.model import AttentionFn, BlockKernels, LossFn, eager_attention, sdpa_attention
from cs336_basics.nn_utils import softmax
from cs336_sharding.checkpointing import POLICY_KINDS
from torch.utils.checkpoint import checkpoint

from cs336_harness.instrument import annotate

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter], float, float], torch.optim.Optimizer]

BUDGET = "budget"
CHECKPOINT_KINDS: tuple[str, ...] = (*POLICY_KINDS, BUDGET)

# The baselines' loss: tokens per chunk of logits.
CHUNK_TOKENS = 4096


def annotated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """The model's attention math, with each stage inside its own NVTX / record_function range."""
    with annotate("attention"):
        with annotate("attention/scores"):
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., Tq, Tk)
            if is_causal:
                keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
                scores = scores.masked_fill(~keep, float("-inf"))
        with annotate("attention/softmax"):
            probs = softmax(scores, dim=-1)
        with annotate("attention/final_matmul"):
            return probs @ v  # (..., Tq, d)


def _triton_attention() -> AttentionFn:
    from cs336_kernels import flash_attention

    def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
        return flash_attention(q, k, v, is_causal=is_causal)

    return triton_attention


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """The mean cross-entropy of ``hidden @ weight.T`` (hidden (N, d), weight (V, d)) against ``targets`` (N,), taken
    ``chunk_tokens`` tokens at a time under ``torch.utils.checkpoint``, so that only one chunk's logits ever exist (in
    the forward, and again in the backward's recomputation); logits upcast to fp32 for the cross-entropy. What a
    PyTorch user writes for a large vocabulary (the leaderboard's baselines)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"need hidden (N, d) and targets (N,), got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    total = sum(checkpoint(_chunk_loss_sum, hidden[i : i + chunk_tokens], weight, targets[i : i + chunk_tokens],
                           use_reentrant=False)
                for i in range(0, hidden.shape[0], chunk_tokens))
    return total / hidden.shape[0]


def _kernel_glue() -> dict[str, Callable]:
    from cs336_kernels import add_rms_norm, rms_norm, rope, silu_mul

    return dict(norm=rms_norm, add_norm=add_rms_norm, rotary=rope, gate=silu_mul)


def _compiled_glue() -> dict[str, Callable]:
    from cs336_kernels import add_rms_norm_reference, rms_norm_reference, rope_reference, silu_mul_reference

    return dict(norm=torch.compile(rms_norm_reference), add_norm=torch.compile(add_rms_norm_reference),
                rotary=torch.compile(rope_reference), gate=torch.compile(silu_mul_reference))


def _fused_loss() -> LossFn:
    from cs336_kernels import fused_linear_cross_entropy

    return fused_linear_cross_entropy


def _adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    from cs336_basics.optimizer import AdamW

    return AdamW(params, lr=lr, weight_decay=weight_decay)


def _torch_adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    params = list(params)
    on_cuda = bool(params) and params[0].device.type == "cuda"
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=on_cuda)


def _fused_adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    from cs336_kernels import FusedAdamW

    return FusedAdamW(params, lr=lr, weight_decay=weight_decay)


# Each name once, with a factory that makes its callable when asked (cached: the compiled entries compile once).
ATTENTIONS: dict[str, Callable[[], AttentionFn]] = {
    "eager": lambda: eager_attention,
    "annotated": lambda: annotated_attention,
    "compiled": lambda: torch.compile(eager_attention),
    "sdpa": lambda: sdpa_attention,
    "triton": _triton_attention,
}
GLUES: dict[str, Callable[[], dict[str, Callable]]] = {"model": dict, "triton": _kernel_glue,
                                                       "compiled": _compiled_glue}
LOSSES: dict[str, Callable[[], LossFn | None]] = {"standard": lambda: None, "fused": _fused_loss,
                                                 "chunked": lambda: chunked_cross_entropy}
OPTIMIZERS: dict[str, OptimizerFactory] = {"adamw": _adamw, "torch-adamw": _torch_adamw, "fused-adamw": _fused_adamw}


def _callable(what: str, piece: object) -> None:
    if not callable(piece):
        raise TypeError(f"{what} must be callable, got {type(piece).__name__}")


def _register(what: str, table: dict[str, object], name: str, entry: object) -> None:
    """Put ``entry`` in ``table`` under ``name``.

    Raises:
        ValueError: for a name that is empty, holds a comma or whitespace (the command line's lists split on commas)
            or is taken.
    """
    if not isinstance(name, str) or not name or any(c == "," or c.isspace() for c in name):
        raise ValueError(f"{what} name must be a non-empty string without commas or spaces, got {name!r}")
    if name in table:
        raise ValueError(f"{what} {name!r} is already registered (as one of {', '.join(table)}); pick another name")
    table[name] = entry


def register_attention(name: str, fn: AttentionFn) -> None:
    """Name ``fn(q, k, v, is_causal) -> out`` (over (batch, heads, seq, head_dim) tensors) as an attention
    (:data:`ATTENTIONS`).

    Raises:
        ValueError: for a name taken or unfit for the command line (no commas, no spaces).
        TypeError: for an ``fn`` that is not callable.
    """
    _callable("attention", fn)
    _register("attention", ATTENTIONS, name, lambda: fn)


def register_glue(name: str, *, norm: Callable | None = None, add_norm: Callable | None = None,
                  rotary: Callable | None = None, gate: Callable | None = None) -> None:
    """Name a set of the block's glue (:data:`GLUES`): any of ``norm``, ``add_norm``, ``rotary`` and ``gate`` with
    the signatures of :class:`cs336_basics.model.BlockKernels`; those not given are the model's own code. Raises as
    :func:`register_attention`."""
    pieces = {k: v for k, v in dict(norm=norm, add_norm=add_norm, rotary=rotary, gate=gate).items() if v is not None}
    for piece, fn in pieces.items():
        _callable(f"glue {piece}", fn)
    _register("glue", GLUES, name, lambda: dict(pieces))


def register_loss(name: str, fn: LossFn) -> None:
    """Name the LM head's loss ``fn(hidden, weight, targets) -> mean loss`` (:data:`LOSSES`). Raises as
    :func:`register_attention`."""
    _callable("loss", fn)
    _register("loss", LOSSES, name, lambda: fn)


def register_optimizer(name: str, factory: OptimizerFactory) -> None:
    """Name ``factory(params, lr, weight_decay) -> Optimizer`` (:data:`OPTIMIZERS`). Raises as
    :func:`register_attention`."""
    _callable("optimizer factory", factory)
    _register("optimizer", OPTIMIZERS, name, factory)


def check_name(what: str, name: object, names: Iterable[str]) -> str:
    """``name`` if it is one of ``names``.

    Raises:
        ValueError: naming ``what`` it was for, the names and what was given.
    """
    names = tuple(names)
    if name not in names:
        raise ValueError(f"{what} must be one of {', '.join(map(str, names))}, got {name!r}")
    return name


@functools.cache
def attention(name: str) -> AttentionFn:
    """The attention function of ``name`` (:data:`ATTENTIONS`)."""
    return ATTENTIONS[check_name("attention", name, ATTENTIONS)]()


@functools.cache
def glue(name: str) -> dict[str, Callable]:
    """The ``norm``, ``add_norm``, ``rotary`` and ``gate`` of the glue ``name`` (:data:`GLUES`; none for ``model``,
    the model's own code)."""
    return GLUES[check_name("glue", name, GLUES)]()


@functools.cache
def loss(name: str) -> LossFn | None:
    """The LM head's loss of ``name`` (:data:`LOSSES`; None for ``standard``, the model's own)."""
    return LOSSES[check_name("loss", name, LOSSES)]()


def optimizer(name: str) -> OptimizerFactory:
    """The optimizer factory of ``name`` (:data:`OPTIMIZERS`)."""
    return OPTIMIZERS[check_name("optimizer", name, OPTIMIZERS)]


def kernels(attention_name: str = "eager", glue_name: str = "model", loss_name: str = "standard") -> BlockKernels:
    """The :class:`~cs336_basics.model.BlockKernels` of these names (the defaults: the model's own code)."""
    return BlockKernels(attention=attention(attention_name), **glue(glue_name), loss=loss(loss_name))

