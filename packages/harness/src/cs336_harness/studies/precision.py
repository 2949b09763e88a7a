"""Small mixed-precision experiments: accumulating in low precision, autocast dtypes, layer norm in fp16/bf16.

- :func:`accumulation_sums`: add 0.01 a thousand times with fp32 or fp16 accumulators and addends.
- :func:`toy_model_dtypes`: under ``torch.autocast``, the dtype of the parameters, of each layer's
  output, of the loss and of the gradients of a two-layer model with a LayerNorm in between.
- :func:`layernorm_error`: a layer norm computed entirely in fp16 or bf16 against fp32, at growing input
  scales, to show which of its steps (squares and sums) break in which format.

``uv run cs336 precision`` prints all three; on a CPU, fp16 autocast runs through CPU autocast.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def accumulation_sums(n: int = 1000, addend: float = 0.01) -> list[dict[str, Any]]:
    """The four sums: (accumulator, addend) in (fp32, fp32), (fp16, fp16), (fp32, fp16), (fp32, fp16 upcast)."""
    variants = {
        "fp32 += fp32": (torch.float32, torch.float32, False),
        "fp16 += fp16": (torch.float16, torch.float16, False),
        "fp32 += fp16": (torch.float32, torch.float16, False),
        "fp32 += fp16.to(fp32)": (torch.float32, torch.float16, True),
    }
    rows = []
    for name, (acc_dtype, add_dtype, upcast) in variants.items():
        s = torch.tensor(0, dtype=acc_dtype)
        for _ in range(n):
            x = torch.tensor(addend, dtype=add_dtype)
            s += x.to(torch.float32) if upcast else x
        rows.append({"sum": name, "value": float(s), "abs_error": abs(float(s) - n * addend)})
    return rows


class ToyModel(nn.Module):
    """fc1 -> ReLU -> LayerNorm -> fc2, no biases in the linears (the handout's toy model, our code)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ln(self.relu(self.fc1(x))))


def toy_model_dtypes(device: str = "cpu", dtype: torch.dtype = torch.float16) -> dict[str, str]:
    """Dtypes seen in one autocast training step of :class:`ToyModel` with fp32 parameters."""
    torch.manual_seed(0)
    model = ToyModel(16, 5).to(device)
    x = torch.randn(8, 16, device=device)
    y = torch.randint(0, 5, (8,), device=device)
    seen: dict[str, str] = {}

    def record(name: str):  # noqa: ANN202
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            seen[f"output of {name}"] = str(out.dtype)

        return hook

    for name in ("fc1", "ln", "fc2"):
        getattr(model, name).register_forward_hook(record(name))
    with torch.autocast(torch.device(device).type, dtype=dtype):
        seen["parameters inside autocast"] = ", ".join(sorted({str(p.dtype) for p in model.parameters()}))
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
    seen["logits"] = str(logits.dtype)
    seen["loss"] = str(loss.dtype)
    loss.backward()
    seen["gradients"] = ", ".join(sorted({str(p.grad.dtype) for p in model.parameters()}))
    return {k: v.removeprefix("torch.") for k, v in seen.items()}


def _layernorm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def layernorm_error(
    scales: tuple[float, ...] = (1.0, 100.0, 1000.0), width: int = 4096, seed: int = 0
) -> list[dict[str, Any]]:
    """Max error of a layer norm computed wholly in fp16 and in bf16 vs fp32, for inputs ~ N(scale, scale)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for scale in scales:
        x = scale + scale * torch.randn(8, width, generator=gen, dtype=torch.float64)
        ref = _layernorm(x)
        for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            low = x.to(dtype)
            sq = ((low - low.mean(-1, keepdim=True)) ** 2).sum(-1)
            out = _layernorm(low).double()
            finite = bool(torch.isfinite(out).all())
            rows.append({
                "input_scale": scale, "dtype": name,
                "sum_of_squares_finite": bool(torch.isfinite(sq).all()),
                "max_abs_error": float((out - ref).abs().max()) if finite else float("nan"),
                "output_finite": finite,
            })
    return rows
