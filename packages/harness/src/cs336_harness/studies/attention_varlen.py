"""Packed documents and sliding windows (``cs336 attention --part varlen``, ``--part window``; issue 53): our attention
over a packed batch against the other ways a user could run it, and a sliding window against FlashAttention-4's and
FlexAttention's, each in one process.

Parts:

- ``varlen``: a packed batch of ``tokens`` tokens (32,768) in documents of seeded random lengths, uniform in
  ``doc_lengths`` (256..8,192) and drawn until they fill the batch, the last one cut to fit
  (:func:`document_lengths`); ``heads`` query and key/value heads (32, 8), d = ``head_dim`` (128), causal within each
  document, bf16; q, k, v as (tokens, heads, d) with int32 ``cu_seqlens``, FlashAttention-2's layout. ``impls``:

  - ``ours``: ``flash_attention_varlen`` as a user calls it (forward and backward ``auto``);
  - ``ours_per_document``: the sum of our dense ``flash_attention`` calls on each document alone. Each document's
    q, k, v (and output gradient) are copied once, before any timing, into dense (1, heads, length, d) tensors of
    their own (:func:`split_documents`); the timed forward is one causal ``flash_attention`` call per document, one
    after another (:func:`per_document_forward`); the timed backward is one ``torch.autograd.backward`` over every
    document's output, which runs each document's backward (their graphs share nothing). No copy, slice or
    concatenation is timed: this is what a packed kernel has to match;
  - ``flex``: FlexAttention under ``torch.compile`` with the documents' mask combined with causal
    (:func:`document_mask_mod`), its block mask built once before the timing, given the packed tensors as
    (1, heads, tokens, d) views;
  - ``sdpa_varlen``: PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (``window_size=(-1, 0)``: causal), a
    ``skipped`` row with a note where this torch lacks it;
  - ``fa4``: FlashAttention-4's ``flash_attn.cute.flash_attn_varlen_func``, a ``skipped`` row with a note where it
    does not import.

- ``window``: a sliding window of ``window`` keys (4,096: each query sees itself and the 4,095 keys before it,
  ``window_size=(4095, 0)`` with causal) over dense (batch, heads, seq, d) = ``window_shape`` (1, 32, 32768, 128)
  tensors, bf16. ``window_impls``: ``ours`` (``flash_attention(q, k, v, is_causal=True, window_size=(4095, 0))``),
  ``fa4`` (``flash_attn_func`` with the same ``window_size``) and ``flex`` (compiled, a sliding-window mask:
  :func:`window_mask_mod`).

The implementations run in the order listed above, whatever order ``impls`` gives. Each row: ``fwd_ms``, ``bwd_ms``
(on one retained graph) and ``fwd_bwd_ms``, ``triton.testing.do_bench`` medians, with their TFLOP/s and a ``status``
(``ok``; ``oom``; ``error`` with the exception in ``error``; ``skipped`` with a ``note``); FA4 rows ``fa4_version``.
Every row but ours has ``ours_ratio_fwd``, ``ours_ratio_bwd`` and ``ours_ratio_fwd_bwd``, ours' time over its own
in the same call (below 1: ours is faster), and ``target_ratio`` where issue 53 sets the most that ours' forward +
backward may take over it. Varlen rows carry ``tokens``, ``heads``, ``heads_kv``, ``d``, ``doc_lengths`` with their
``doc_seed`` and ``doc_range``; window rows ``batch``, ``heads``, ``seq``, ``d``, ``window`` and ``window_size``.

FLOPs count the (query, key) pairs each query sees in the convention of
:func:`~cs336_harness.studies.attention.causal_attention_flops` (s^2/2 pairs for a causal sequence of s): a document
of length L has L^2/2; a window of W keys over s queries W^2/2 + (s - W) * W.

Usage::

    from cs336_harness.studies.attention_varlen import VarlenBenchConfig, run_varlen_bench
    rows = run_varlen_bench(VarlenBenchConfig(parts=("varlen",)))
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from cs336_kernels import flash_attention, flash_attention_varlen

from cs336_harness.analysis.tables import markdown_table
from cs336_harness.studies.attention import (
    attention_flops,
    fa4_attention,
    fa4_dense,
    fa4_version,
    flex_attention_impl,
    measure_ms,
    timed_row,
)

VARLEN_PARTS: tuple[str, ...] = ("varlen", "window")
VARLEN_IMPLS: tuple[str, ...] = ("ours", "ours_per_document", "flex", "sdpa_varlen", "fa4")
WINDOW_IMPLS: tuple[str, ...] = ("ours", "fa4", "flex")
# Issue 53's targets: the most ours' forward + backward may take over each baseline's in the same call.
TARGET_RATIO: dict[str, dict[str, float]] = {"varlen": {"ours_per_document": 1.05, "fa4": 1.00, "flex": 0.7},
                                             "window": {"fa4": 1.00}}
_MODES = ("fwd", "bwd", "fwd_bwd")

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class VarlenBenchConfig:
    parts: tuple[str, ...] = VARLEN_PARTS
    tokens: int = 32768
    heads: tuple[int, int] = (32, 8)  # query heads, key/value heads
    head_dim: int = 128
    doc_lengths: tuple[int, int] = (256, 8192)  # the shortest and longest document drawn
    seed: int = 0
    impls: tuple[str, ...] = VARLEN_IMPLS
    window_shape: tuple[int, int, int, int] = (1, 32, 32768, 128)
    window: int = 4096
    window_impls: tuple[str, ...] = WINDOW_IMPLS
    warmup_ms: int = 10
    rep_ms: int = 1000

    def __post_init__(self) -> None:
        for name, allowed in (("parts", VARLEN_PARTS), ("impls", VARLEN_IMPLS), ("window_impls", WINDOW_IMPLS)):
            given = getattr(self, name)
            if not given or set(given) - set(allowed):
                raise ValueError(f"{name} must be a non-empty subset of {allowed}, got {given}")
        for name in ("tokens", "window", "warmup_ms", "rep_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if len(self.heads) != 2 or min(self.heads) <= 0 or self.heads[0] % self.heads[1]:
            raise ValueError(f"heads must be (query heads, key/value heads), positive, the first a multiple of the "
                             f"second; got {self.heads}")
        if not 16 <= self.head_dim <= 256:
            raise ValueError(f"head_dim must lie in [16, 256], got {self.head_dim}")
        if len(self.doc_lengths) != 2 or not 1 <= self.doc_lengths[0] <= self.doc_lengths[1]:
            raise ValueError(f"doc_lengths must be (shortest, longest) with 1 <= shortest <= longest, got "
                             f"{self.doc_lengths}")
        if len(self.window_shape) != 4 or min(self.window_shape) <= 0:
            raise ValueError(f"window_shape must be (batch, heads, seq, d) of positive ints, got {self.window_shape}")


def document_lengths(tokens: int, shortest: int, longest: int, seed: int) -> list[int]:
    """Document lengths drawn uniformly from ``shortest..longest`` (both included) by a ``random.Random(seed)`` until
    they hold ``tokens`` tokens, the last one cut to fit: the same lengths for the same arguments on every machine."""
    if tokens <= 0 or not 1 <= shortest <= longest:
        raise ValueError(f"expected tokens > 0 and 1 <= shortest <= longest, got tokens={tokens}, "
                         f"shortest={shortest}, longest={longest}")
    rng = random.Random(seed)
    lengths: list[int] = []
    left = tokens
    while left:
        lengths.append(min(rng.randint(shortest, longest), left))
        left -= lengths[-1]
    return lengths


def cu_seqlens_of(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """The int32 cumulative lengths ``[0, l0, l0 + l1, ...]`` of FlashAttention-2's packed layout."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def document_mask_mod(lengths: Sequence[int], device: torch.device) -> Callable[..., torch.Tensor]:
    """FlexAttention's ``mask_mod`` of packed documents of ``lengths``, causal within each: a query sees the keys of
    its own document up to itself."""
    document = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                       torch.tensor(lengths, device=device))

    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    return mask_mod


def window_mask_mod(window: int) -> Callable[..., torch.Tensor]:
    """FlexAttention's ``mask_mod`` of a causal sliding window of ``window`` keys: a query sees itself and the
    ``window - 1`` keys before it (FlashAttention's ``window_size=(window - 1, 0)``)."""

    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return mask_mod


def sdpa_varlen_attention() -> tuple[Callable[..., Any] | None, str | None]:
    """PyTorch's ``torch.nn.attention.varlen.varlen_attn``, or None and why this torch cannot run it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn: {e}"
    return varlen_attn, None


def unavailable(name: str, bench: str) -> str | None:
    """Why the implementation ``name`` of the part ``bench`` (``varlen``, ``window``) cannot run here, or None."""
    if name == "sdpa_varlen":
        return sdpa_varlen_attention()[1]
    if name == "fa4":
        return fa4_attention("flash_attn_varlen_func" if bench == "varlen" else "flash_attn_func")[1]
    return None


def varlen_impl(name: str, lengths: Sequence[int], device: torch.device) -> Attention:
    """Causal attention within each packed document of ``lengths`` over (tokens, heads, d) q, k, v by the
    implementation ``name`` of :data:`VARLEN_IMPLS` but ``ours_per_document`` (which takes each document apart:
    :func:`per_document_forward`); the output is (tokens, query heads, d)."""
    cu_seqlens = cu_seqlens_of(lengths, device)
    longest = max(lengths)
    if name == "ours":
        return lambda q, k, v: flash_attention_varlen(q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=True)
    if name == "flex":
        dense = flex_attention_impl(document_mask_mod(lengths, device), sum(lengths), device)
        # The packed (tokens, heads, d) tensors seen as one (1, heads, tokens, d) sequence, without a copy.
        return lambda q, k, v: dense(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)))[0].transpose(0, 1)
    if name == "sdpa_varlen":
        varlen_attn, why_not = sdpa_varlen_attention()
        if varlen_attn is None:
            raise RuntimeError(why_not)
        return lambda q, k, v: varlen_attn(q, k, v, cu_seqlens, cu_seqlens, longest, longest, window_size=(-1, 0))
    if name == "fa4":
        fa4, why_not = fa4_attention("flash_attn_varlen_func")
        if fa4 is None:
            raise RuntimeError(why_not)
        # FA4 takes the packed layout as it is and returns (out, lse).
        return lambda q, k, v: fa4(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=longest,
                                   max_seqlen_k=longest, causal=True)[0]
    raise ValueError(f"varlen_impl takes ours, flex, sdpa_varlen or fa4 (ours_per_document is per_document_forward), "
                     f"got {name!r}")


def window_impl(name: str, window: int, seq: int, device: torch.device) -> Attention:
    """Causal attention over (b, h, s, d) q, k, v in a sliding window of ``window`` keys by the implementation
    ``name`` of :data:`WINDOW_IMPLS`."""
    window_size = (window - 1, 0)
    if name == "ours":
        return lambda q, k, v: flash_attention(q, k, v, is_causal=True, window_size=window_size)
    if name == "fa4":
        return fa4_dense(window_size=window_size)
    if name == "flex":
        return flex_attention_impl(window_mask_mod(window), seq, device)
    raise ValueError(f"window impl must be one of {WINDOW_IMPLS}, got {name!r}")


def window_pairs(seq: int, window: int) -> float:
    """The (query, key) pairs of a causal sliding window of ``window`` keys over ``seq`` queries, in the convention
    of :func:`~cs336_harness.studies.attention.causal_attention_flops` (``seq**2 / 2`` without a window):
    ``W**2 / 2 + (seq - W) * W`` for ``W = min(window, seq)``."""
    seen = min(window, seq)
    return seen * seen / 2 + (seq - seen) * seen


def split_documents(t: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Each document's rows of a packed (tokens, heads, d) tensor as a dense (1, heads, length, d) tensor of its own
    (a copy, cut from the graph)."""
    return [d.transpose(0, 1).unsqueeze(0).contiguous() for d in t.detach().split(list(lengths))]


def per_document_forward(documents: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                         ) -> tuple[torch.Tensor, ...]:
    """One dense causal :func:`~cs336_kernels.flash_attention` call per document's (1, heads, length, d) q, k, v,
    one after another: the forward that ``ours_per_document`` times."""
    return tuple(flash_attention(q, k, v, is_causal=True) for q, k, v in documents)


def _per_document_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lengths: Sequence[int],
                     warmup_ms: int, rep_ms: int) -> dict[str, Any]:
    documents = list(zip(*(split_documents(t, lengths) for t in (q, k, v)), strict=True))
    leaves = [t.requires_grad_() for document in documents for t in document]
    grads = split_documents(do, lengths)
    return measure_ms(lambda: per_document_forward(documents), grads, leaves, warmup_ms, rep_ms)


def _with_ratios(row: dict[str, Any], ours: dict[str, Any] | None) -> dict[str, Any]:
    """``row`` with ours' time over its own in each mode (None where either is missing) and its target, if any."""
    if row["impl"] == "ours" or row.get("status") in ("skipped", "error"):
        return row
    for mode in _MODES:
        mine, theirs = row.get(f"{mode}_ms"), None if ours is None else ours.get(f"{mode}_ms")
        row[f"ours_ratio_{mode}"] = None if mine is None or theirs is None else theirs / mine
    row["target_ratio"] = TARGET_RATIO[row["bench"]].get(row["impl"])
    return row


def _compare(base: dict[str, Any], names: Sequence[str], make_inputs: Callable[[], tuple[torch.Tensor, ...]],
             measure: Callable[[str, tuple[torch.Tensor, ...]], dict[str, Any]], flops: dict[str, float],
             ) -> Iterator[dict[str, Any]]:
    """One row per implementation of ``names``: ``base`` with what ``measure(name, inputs)`` timed (inputs made once,
    for the first implementation that runs), ratios against ours, or why it was skipped."""
    inputs: tuple[torch.Tensor, ...] = ()
    ours = None
    for name in names:
        row = base | {"impl": name}
        why_not = unavailable(name, base["bench"])
        if why_not is not None:
            yield row | {"status": "skipped", "note": why_not}
            continue
        if name == "fa4":
            row["fa4_version"] = fa4_version()
        inputs = inputs or make_inputs()
        row = timed_row(row, functools.partial(measure, name, inputs), flops, inputs, f"{base['bench']} {name}")
        if name == "ours":
            ours = row
        yield _with_ratios(row, ours)


def varlen_rows(cfg: VarlenBenchConfig) -> Iterator[dict[str, Any]]:
    """The ``varlen`` part's rows (module docstring)."""
    lengths = document_lengths(cfg.tokens, *cfg.doc_lengths, cfg.seed)
    heads, heads_kv = cfg.heads
    device = torch.device("cuda")
    base = {"bench": "varlen", "dtype": "bf16", "tokens": cfg.tokens, "heads": heads, "heads_kv": heads_kv,
            "d": cfg.head_dim, "causal": True, "docs": len(lengths), "doc_lengths": lengths, "doc_seed": cfg.seed,
            "doc_range": list(cfg.doc_lengths), "rep_ms": cfg.rep_ms}

    def make_inputs() -> tuple[torch.Tensor, ...]:
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        return tuple(torch.randn(cfg.tokens, h, cfg.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
                     .requires_grad_() for h in (heads, heads_kv, heads_kv))

    def measure(name: str, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        q, k, v = inputs
        do = torch.randn_like(q)
        if name == "ours_per_document":
            return _per_document_ms(q, k, v, do, lengths, cfg.warmup_ms, cfg.rep_ms)
        impl = varlen_impl(name, lengths, device)
        return measure_ms(lambda: impl(q, k, v), do, inputs, cfg.warmup_ms, cfg.rep_ms)

    flops = attention_flops(heads, cfg.head_dim, sum(n * n / 2 for n in lengths))
    yield from _compare(base, [n for n in VARLEN_IMPLS if n in cfg.impls], make_inputs, measure, flops)


def window_rows(cfg: VarlenBenchConfig) -> Iterator[dict[str, Any]]:
    """The ``window`` part's rows (module docstring)."""
    batch, heads, seq, head_dim = cfg.window_shape
    device = torch.device("cuda")
    base = {"bench": "window", "dtype": "bf16", "batch": batch, "heads": heads, "seq": seq, "d": head_dim,
            "causal": True, "window": cfg.window, "window_size": [cfg.window - 1, 0], "rep_ms": cfg.rep_ms}

    def make_inputs() -> tuple[torch.Tensor, ...]:
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        return tuple(torch.randn(cfg.window_shape, device=device, dtype=torch.bfloat16, generator=gen)
                     .requires_grad_() for _ in range(3))

    def measure(name: str, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        impl = window_impl(name, cfg.window, seq, device)
        return measure_ms(lambda: impl(*inputs), torch.randn_like(inputs[0]), inputs, cfg.warmup_ms, cfg.rep_ms)

    flops = attention_flops(heads, head_dim, batch * window_pairs(seq, cfg.window))
    yield from _compare(base, [n for n in WINDOW_IMPLS if n in cfg.window_impls], make_inputs, measure, flops)


def run_varlen_bench(cfg: VarlenBenchConfig, on_row: Callable[[dict[str, Any]], None] | None = None,
                     ) -> list[dict[str, Any]]:
    """Run the configured parts; every row is also passed to ``on_row`` as soon as it is measured."""
    if not torch.cuda.is_available():
        raise RuntimeError("the varlen and window attention benchmarks need a CUDA GPU")
    rows = []
    for part, make_rows in (("varlen", varlen_rows), ("window", window_rows)):
        if part in cfg.parts:
            for row in make_rows(cfg):
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows


# --------------------------------------------------------------------------------------- markdown tables


def _latest_call(rows: Sequence[dict[str, Any]], bench: str, order: Sequence[str]) -> list[dict[str, Any]]:
    """The timed rows of ``bench`` from the call of its latest timed ``ours`` row, the last of each implementation,
    in ``order``."""
    timed = sorted((r for r in rows if r.get("bench") == bench and r.get("impl") in order
                    and r.get("status") in ("ok", "oom")), key=lambda r: r.get("date", ""))
    ours = [r for r in timed if r["impl"] == "ours"]
    if not ours:
        return []
    call = ours[-1].get("call_id")
    last = {r["impl"]: r for r in timed if r.get("call_id") == call}
    return sorted(last.values(), key=lambda r: order.index(r["impl"]))


_COLUMNS = [("impl", "impl"), ("fwd_ms", "fwd (ms)"), ("bwd_ms", "bwd (ms)"), ("fwd_bwd_ms", "fwd+bwd (ms)"),
            ("fwd_bwd_tflops", "fwd+bwd TFLOP/s"), ("ours_ratio_fwd", "ours / it, fwd"),
            ("ours_ratio_bwd", "ours / it, bwd"), ("ours_ratio_fwd_bwd", "ours / it, fwd+bwd"),
            ("target_ratio", "target (ours / it, fwd+bwd)")]


def varlen_tables(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The markdown tables of the ``varlen`` and ``window`` rows, by name (``varlen``, ``window``): each from the
    latest call that timed ours, one line per implementation, ours' time over each baseline's."""
    tables = {}
    packed = _latest_call(rows, "varlen", VARLEN_IMPLS)
    if packed:
        r = packed[0]
        tables["varlen"] = (
            f"Packed batch of {r['tokens']} tokens in {r['docs']} documents (lengths uniform in "
            f"{r['doc_range'][0]}-{r['doc_range'][1]}, seed {r['doc_seed']}), {r['heads']} query and {r['heads_kv']} "
            f"key/value heads, d {r['d']}, causal, bf16, do_bench medians, {r.get('device', '-')}:\n\n"
            + markdown_table(packed, _COLUMNS)
        )
    windowed = _latest_call(rows, "window", WINDOW_IMPLS)
    if windowed:
        r = windowed[0]
        tables["window"] = (
            f"Sliding window of {r['window']} keys, (b, h, s, d) = ({r['batch']}, {r['heads']}, {r['seq']}, {r['d']}), "
            f"causal, bf16, do_bench medians, {r.get('device', '-')}:\n\n" + markdown_table(windowed, _COLUMNS)
        )
    return tables
