"""Bad inputs inside ``torch.compile`` raise what they raise eagerly.

Every public function checks its inputs in Python before it calls its operator, so Dynamo traces the checks. Compiled
as ``torch.compile`` does by default, a check that fails breaks the graph and the call raises the eager exception,
type and message; with ``fullgraph=True`` Dynamo turns every raise into an ``Unsupported`` error, which quotes the
message. The device check (CPU tensors without Triton's interpreter) and the interpreter's bf16 check are among
them: each is a constant to Dynamo, not a query it cannot trace.
"""

from __future__ import annotations

from collections.abc import Callable

import cs336_kernels.interpreter
import pytest
import torch
import torch._dynamo.exc
from cs336_kernels import add_rms_norm, flash_attention, fused_linear_cross_entropy, rms_norm, rope, silu_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _t(*shape: int, device: str = DEVICE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, device=device).to(dtype)


def _rope_args(device: str, positions_dtype: torch.dtype = torch.int64) -> tuple:
    angles = _t(16, 4, device=device)
    return (_t(2, 7, 3, 8, device=device), _t(2, 7, 1, 8, device=device), angles.cos(), angles.sin(),
            torch.arange(7, device=device, dtype=positions_dtype))


# (function, its arguments, whether Triton's interpreter is on (None: as this process has it), what the eager error
# says): CPU tensors without the interpreter, bf16 in the interpreter, and one input check of each function.
CASES: dict[str, tuple[Callable, Callable[[], tuple], bool | None, str]] = {
    **{f"{fn.__name__}_cpu_without_interpreter": (fn, args, False, f"{fn.__name__} runs Triton kernels on CUDA tensors")
       for fn, args in (
           (rms_norm, lambda: (_t(3, 5, 16, device="cpu"), _t(16, device="cpu"))),
           (add_rms_norm, lambda: (_t(3, 5, 16, device="cpu"), _t(3, 5, 16, device="cpu"), _t(16, device="cpu"))),
           (rope, lambda: _rope_args("cpu")),
           (silu_mul, lambda: (_t(3, 5, 16, device="cpu"), _t(3, 5, 16, device="cpu"))),
           (fused_linear_cross_entropy, lambda: (_t(6, 16, device="cpu"), _t(11, 16, device="cpu"),
                                                 torch.arange(6) % 11)),
           (flash_attention, lambda: tuple(_t(1, 2, 9, 16, device="cpu") for _ in range(3))),
       )},
    "flash_attention_bf16_in_interpreter": (
        flash_attention, lambda: tuple(_t(1, 2, 9, 16, device="cpu", dtype=torch.bfloat16) for _ in range(3)), True,
        "flash_attention got bfloat16 tensors on CPU"),
    "rms_norm_weight_shape": (rms_norm, lambda: (_t(3, 5, 16), _t(7)), None,
                              "x must be (..., d) and weight (d,)"),
    "add_rms_norm_delta_dtype": (add_rms_norm, lambda: (_t(3, 16), _t(3, 16, dtype=torch.float16), _t(16)),
                                 None, "delta must have x's dtype"),
    "rope_positions_dtype": (rope, lambda: _rope_args(DEVICE, torch.float32), None,
                             "positions must be int32 or int64"),
    "silu_mul_shapes": (silu_mul, lambda: (_t(3, 16), _t(3, 8)), None,
                        "a and b must have one shape"),
    "fused_linear_cross_entropy_reduction": (
        lambda h, w, t: fused_linear_cross_entropy(h, w, t, "avg"),
        lambda: (_t(6, 16), _t(11, 16), torch.arange(6, device=DEVICE) % 11), None,
        "reduction must be one of"),
    "flash_attention_layouts": (flash_attention, lambda: (_t(1, 2, 9, 16), _t(2, 9, 16), _t(2, 9, 16)),
                                None, "q, k, v must all be (batch, seq, d)"),
}

# The quick run keeps the README's case (the device check) and one input check.
QUICK = ("rms_norm_cpu_without_interpreter", "silu_mul_shapes")


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name in QUICK else pytest.mark.slow)
                                  for name in CASES])
def test_compiled_call_raises_the_eager_error(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fn, args, interpret, says = CASES[name]
    if interpret is not None:
        monkeypatch.setattr(cs336_kernels.interpreter, "INTERPRET", interpret)
    with pytest.raises((ValueError, TypeError)) as eager:
        fn(*args())
    assert says in str(eager.value)
    torch._dynamo.reset()
    with pytest.raises(type(eager.value)) as compiled:
        torch.compile(fn, backend="aot_eager")(*args())
    assert str(compiled.value) == str(eager.value)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as fullgraph:
        torch.compile(fn, backend="aot_eager", fullgraph=True)(*args())
    assert f"raised exception {type(eager.value).__name__}(" in str(fullgraph.value)
    assert says in str(fullgraph.value)
    torch._dynamo.reset()
