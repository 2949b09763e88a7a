"""What our attention's deterministic backward costs, measured every way a user asks for it, in one process.

At one shape (default (1, 32, 32768, 128), bf16, causal) the backward alone (``out.backward(do, retain_graph=True)``
under ``triton.testing.do_bench``, gradients reset between repetitions, as ``cs336 attention --part anchors`` times
it) of ``flash_attention`` by default, then in deterministic mode four ways, in turns, ``--passes`` times:

- ``global``: under ``torch.use_deterministic_algorithms(True)``, as the anchors part and a training script set it
  (PyTorch then also fills every new tensor's memory with NaN: ``torch.utils.deterministic.fill_uninitialized_memory``);
- ``global_no_fill``: the same with that fill turned off;
- ``argument``: ``flash_attention(..., deterministic=True)`` with the global setting off;
- ``gradients_accumulate``: ``global`` without resetting the gradients between repetitions, as a loop that calls
  ``loss.backward()`` on leaves that keep their ``.grad`` does.

Each pass times the modes starting one later than the pass before; each row has the median ms, the ratio to the
default of its pass, the pass's order, and provenance::

    bash tools/gpu.sh python3 tools/deterministic_attention.py --out $OUT/deterministic_attention.jsonl
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.utils.deterministic
from cs336_harness.results import append_rows, provenance
from cs336_kernels import flash_attention
from triton.testing import do_bench

MODES = ("default", "global", "global_no_fill", "argument", "gradients_accumulate")


@contextlib.contextmanager
def _mode(mode: str):
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(mode in ("global", "global_no_fill", "gradients_accumulate"))
    torch.utils.deterministic.fill_uninitialized_memory = mode != "global_no_fill"
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def backward_ms(mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, rep_ms: int) -> float:
    """The median backward of one retained graph in ``mode`` (one of :data:`MODES`)."""
    with _mode(mode):
        out = flash_attention(q, k, v, True, deterministic=mode == "argument")
        reset = [] if mode == "gradients_accumulate" else [q, k, v]
        ms = do_bench(lambda: out.backward(do, retain_graph=True), warmup=100, rep=rep_ms, grad_to_none=reset,
                      return_mode="median")
    for t in (q, k, v):
        t.grad = None
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON-lines file the rows are appended to")
    parser.add_argument("--shape", default="1,32,32768,128", help="batch,heads,seq,head_dim")
    parser.add_argument("--passes", type=int, default=len(MODES))
    parser.add_argument("--rep-ms", type=int, default=1000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("deterministic_attention.py times a GPU kernel; no CUDA device is visible")
    shape = tuple(int(x) for x in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    meta = provenance()
    for run in range(args.passes):
        # Each pass starts one mode later, so that no mode is always timed on the hottest (slowest-clocked) GPU;
        # the ratios are to the default of the same pass.
        order = MODES[run % len(MODES):] + MODES[:run % len(MODES)]
        times = {mode: backward_ms(mode, q, k, v, do, args.rep_ms) for mode in order}
        for mode in order:
            ms = times[mode]
            row = {"bench": "deterministic_backward", "mode": mode, "pass": run, "order": list(order),
                   "shape": list(shape), "dtype": "bf16", "causal": True, "bwd_ms": ms,
                   "ratio_vs_default": ms / times["default"]}
            print(f"{mode:>22}  {ms:8.3f} ms  {ms / times['default']:.3f}x", flush=True)
            append_rows(args.out, [row], meta)


if __name__ == "__main__":
    main()
