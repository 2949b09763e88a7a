"""Autotuning of the FlashAttention-2 kernels: tile tables, config lists, pruning and the autotune key.

Each of the three autotuned kernels (``"fwd"``, ``"dkdv"``, ``"dq"``) has a short table of
(BLOCK_M, BLOCK_N, num_warps, num_stages) per regime, a regime being (bytes per element, head dim
padded to a power of two). Every distinct entry of a kernel's tables is one ``triton.Config``; before any
timing, the pruner keeps only those of the launch's regime, so a cold start times two or four configs.
A second table per kernel repeats some 16-bit entries with the tiles its main loop re-reads loaded by
TMA (tensor descriptors); those are kept only where TMA can run (Hopper or newer, aligned strides).

Public: :data:`KERNELS`, :data:`TMA_FLAGS`, :func:`listed_configs`, :func:`autotuned_kernel` (to read
what the autotuner timed and picked) and :func:`extra_configs` (to widen the lists for a sweep, as
the harness's ``cs336 tune`` does). Under the interpreter every kernel has one tiny config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import triton

from cs336_kernels.interpreter import INTERPRET

__all__ = ["KERNELS", "TMA_FLAGS", "Entry", "Regime", "autotuned_kernel", "extra_configs", "listed_configs"]

KERNELS = ("fwd", "dkdv", "dq")
"""The autotuned kernels: the forward, the dK/dV kernel and the dQ kernel."""
Entry = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
Regime = tuple[int, int]  # (bytes per element, padded head dim)

# 16-bit d = 64, 128 and the backward's d = 256 hold the two fastest configs of the wide sweep (``cs336 tune``,
# rows in writeup/results/attention_tuning.jsonl); the other entries are sm_90 builds with few register
# spills. fp32 runs on FMA units, not tensor cores, and needs far smaller tiles. BLOCK_M counts queries and
# BLOCK_N keys in every kernel; the forward and dQ kernels loop over key tiles and need BLOCK_N | BLOCK_M,
# the dK/dV kernel loops over query tiles and needs BLOCK_M | BLOCK_N.
_FWD_TABLE: dict[Regime, list[Entry]] = {
    (2, 16): [(128, 64, 4, 3), (128, 128, 8, 3)],
    (2, 32): [(128, 64, 4, 3), (128, 128, 8, 3)],
    (2, 64): [(64, 64, 4, 3), (128, 64, 4, 4)],
    (2, 128): [(128, 128, 8, 3), (128, 64, 8, 3)],
    (2, 256): [(64, 64, 8, 2), (128, 32, 8, 2)],
    (4, 16): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (4, 32): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (4, 64): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (4, 128): [(32, 16, 8, 2), (16, 16, 4, 2)],
    (4, 256): [(16, 16, 8, 1), (16, 16, 4, 1)],
}
_DKDV_TABLE: dict[Regime, list[Entry]] = {
    (2, 16): [(64, 128, 8, 3), (64, 64, 4, 3)],
    (2, 32): [(64, 128, 8, 3), (64, 64, 4, 3)],
    (2, 64): [(64, 64, 4, 3), (64, 128, 8, 3)],
    (2, 128): [(32, 128, 8, 3), (64, 128, 8, 2)],
    (2, 256): [(32, 64, 8, 2), (32, 32, 8, 2)],
    (4, 16): [(32, 32, 8, 2), (16, 32, 4, 2)],
    (4, 32): [(32, 32, 8, 2), (16, 32, 4, 2)],
    (4, 64): [(32, 32, 8, 2), (16, 32, 4, 2)],
    (4, 128): [(16, 32, 8, 2), (16, 16, 4, 2)],
    (4, 256): [(16, 16, 8, 1), (16, 16, 4, 1)],
}
_DQ_TABLE: dict[Regime, list[Entry]] = {
    (2, 16): [(128, 64, 8, 3), (128, 128, 8, 2)],
    (2, 32): [(128, 64, 8, 3), (128, 128, 8, 2)],
    (2, 64): [(64, 64, 4, 4), (128, 128, 8, 3)],
    (2, 128): [(128, 64, 8, 3), (128, 32, 8, 3)],
    (2, 256): [(128, 32, 8, 2), (64, 64, 8, 2)],
    (4, 16): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (4, 32): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (4, 64): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (4, 128): [(32, 16, 8, 2), (16, 16, 4, 2)],
    (4, 256): [(16, 16, 8, 1), (16, 16, 4, 1)],
}
# The listed 16-bit tiles again with the main loop's re-read tiles loaded by TMA: K and V in the forward and
# dQ kernels, Q and dO in the dK/dV kernel. Both load paths stay in the lists because which one wins depends
# on the tile (writeup/results/attention_notes.md has the builds and timings behind these entries).
_FWD_TMA_TABLE: dict[Regime, list[Entry]] = {
    (2, 64): [(64, 64, 4, 3), (128, 64, 4, 4)],
    (2, 128): [(128, 128, 8, 3), (128, 64, 8, 3)],
}
_DKDV_TMA_TABLE: dict[Regime, list[Entry]] = {
    (2, 64): [(64, 64, 4, 3), (64, 128, 8, 3)],
    (2, 128): [(64, 128, 8, 2), (32, 128, 8, 3)],
}
_DQ_TMA_TABLE: dict[Regime, list[Entry]] = {
    (2, 64): [(64, 64, 4, 4), (128, 128, 8, 3)],
    (2, 128): [(128, 64, 8, 3), (128, 32, 8, 3)],
}
_INTERPRETER_CONFIG: Entry = (16, 16, 1, 1)
# Per kernel: its table and its TMA table (the pruners hold these very dicts; extra_configs edits them in place).
_TABLES = {
    "fwd": (_FWD_TABLE, _FWD_TMA_TABLE), "dkdv": (_DKDV_TABLE, _DKDV_TMA_TABLE), "dq": (_DQ_TABLE, _DQ_TMA_TABLE)
}
TMA_FLAGS: dict[str, str] = {"fwd": "KV_TMA", "dkdv": "QDO_TMA", "dq": "KV_TMA"}
"""Per kernel, the constexpr that switches its main-loop loads to TMA."""
# Per kernel, the tensors its TMA loads read, with their stride prefixes.
_TMA_TENSORS = {"fwd": {"K": "k", "V": "v"}, "dkdv": {"Q": "q", "DO": "do"}, "dq": {"K": "k", "V": "v"}}
_AUTOTUNE_KEY = ["N_QUERIES", "N_KEYS", "HEAD_DIM", "WIN_L", "WIN_R", "SOFTCAP", "VARLEN"]
_AUTOTUNED: dict[str, triton.runtime.Autotuner] = {}


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def _configs(kernel: str) -> list[triton.Config]:
    """One config per distinct entry of ``kernel``'s tables; those of its TMA table also set its TMA flag."""
    table, tma_table = _TABLES[kernel]
    if INTERPRET:
        entries = {(*_INTERPRETER_CONFIG, False)}
    else:
        entries = {(*entry, False) for entries in table.values() for entry in entries}
        entries |= {(*entry, True) for entries in tma_table.values() for entry in entries}
    flag = TMA_FLAGS[kernel]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n} | ({flag: True} if tma else {}), num_warps=w, num_stages=s)
        for m, n, w, s, tma in sorted(entries)
    ]


def _tma_ok(named_args: dict, tensors: dict[str, str]) -> bool:
    # A tensor descriptor needs a Hopper-or-newer GPU, a 16-byte-aligned base for every (batch, head) and
    # positive 16-byte row strides (TMA's rules; an upstream expand can leave dO with row stride 0); the d
    # stride is already 1 here.
    loaded = [named_args[name] for name in tensors]
    if not loaded[0].is_cuda or torch.cuda.get_device_capability(loaded[0].device)[0] < 9:
        return False
    strides = [named_args[f"stride_{prefix}{axis}"] for prefix in tensors.values() for axis in "bht"]
    rows_ok = all(named_args[f"stride_{prefix}t"] > 0 for prefix in tensors.values())
    return rows_ok and all(t.data_ptr() % 16 == 0 for t in loaded) and all(
        s * loaded[0].element_size() % 16 == 0 for s in strides
    )


def _pruner(kernel: str) -> dict[str, Callable]:
    table, tma_table = _TABLES[kernel]
    flag = TMA_FLAGS[kernel]

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        key = (named_args["Q"].element_size(), kwargs["BLOCK_D"])
        wanted = {(*entry, False) for entry in table[key]}
        if _tma_ok(named_args, _TMA_TENSORS[kernel]):
            wanted |= {(*entry, True) for entry in tma_table.get(key, [])}
        return [
            c for c in configs
            if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.kwargs.get(flag, False))
            in wanted
        ]

    return {"early_config_prune": prune}


def _quick_bench(fn, quantiles=None):
    # Autotuning runs once per new shape; a short measurement keeps a cold sweep over many shapes fast.
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def autotune(kernel: str) -> Callable[[triton.JITFunction], triton.runtime.Autotuner]:
    """The ``triton.autotune`` decorator of ``kernel`` ("fwd", "dkdv" or "dq") over its tables."""
    _check_kernel(kernel)

    def decorate(fn: triton.JITFunction) -> triton.runtime.Autotuner:
        tuned = triton.autotune(
            configs=_configs(kernel), key=_AUTOTUNE_KEY, prune_configs_by=_pruner(kernel), do_bench=_quick_bench,
        )(fn)
        _AUTOTUNED[kernel] = tuned
        return tuned

    return decorate


def autotuned_kernel(kernel: str) -> triton.runtime.Autotuner:
    """The autotuned kernel ``kernel`` ("fwd", "dkdv" or "dq"), for reading what its autotuner timed
    (``configs_timings``) and launched last (``best_config``), or its ``fn`` to compile it offline."""
    _check_kernel(kernel)
    return _AUTOTUNED[kernel]


def listed_configs(kernel: str, *, tma: bool = False) -> dict[Regime, list[Entry]]:
    """A copy of ``kernel``'s table (``tma=True``: its table of configs that load by TMA), per regime."""
    _check_kernel(kernel)
    return {regime: list(entries) for regime, entries in _TABLES[kernel][int(tma)].items()}


def _check_entry(kernel: str, entry: Entry) -> None:
    if len(entry) != 4 or not all(isinstance(x, int) and x > 0 for x in entry):
        raise ValueError(f"a config is four positive ints (BLOCK_M, BLOCK_N, num_warps, num_stages), got {entry!r}")
    block_m, block_n, num_warps, _ = entry
    if any(x & (x - 1) for x in (block_m, block_n, num_warps)) or min(block_m, block_n) < 16:
        raise ValueError(f"BLOCK_M and BLOCK_N must be powers of two >= 16 and num_warps a power of two, got {entry}")
    inner, outer = (block_m, block_n) if kernel == "dkdv" else (block_n, block_m)
    if outer % inner:
        need = "BLOCK_M | BLOCK_N" if kernel == "dkdv" else "BLOCK_N | BLOCK_M"
        raise ValueError(f"the {kernel} kernel needs {need}, got {entry}")


@contextlib.contextmanager
def extra_configs(extra: Mapping[str, Mapping[Regime, Sequence[Entry]]]) -> Iterator[None]:
    """Add ``extra[kernel][regime]`` to each kernel's table while the block runs (configs that load by
    pointers, not TMA), then restore the tables. On entry and exit the changed kernels forget what they
    autotuned, so the next launch of each shape times the current list. Under the interpreter the kernels
    keep their one config.

    Args:
        extra: kernel name ("fwd", "dkdv", "dq") -> regime (bytes per element, padded head dim) -> entries
            (BLOCK_M, BLOCK_N, num_warps, num_stages).
    """
    saved = {}
    for kernel, regimes in extra.items():
        _check_kernel(kernel)
        table = _TABLES[kernel][0]
        for regime, entries in regimes.items():
            if regime not in table:
                raise ValueError(f"regime must be one of {sorted(table)} for {kernel}, got {regime!r}")
            for entry in entries:
                _check_entry(kernel, tuple(entry))
        saved[kernel] = dict(table)
    try:
        for kernel, regimes in extra.items():
            table = _TABLES[kernel][0]
            for regime, entries in regimes.items():
                table[regime] = list(dict.fromkeys([*table[regime], *map(tuple, entries)]))
            _refresh(kernel)
        yield
    finally:
        for kernel, table in saved.items():
            _TABLES[kernel][0].update(table)
            _refresh(kernel)


def _refresh(kernel: str) -> None:
    tuned = _AUTOTUNED[kernel]
    tuned.configs = _configs(kernel)
    tuned.cache.clear()
