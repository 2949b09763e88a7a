"""The training step of Hugging Face models with random weights, three ways (``cs336 hf``): HF as it comes (SDPA
attention), HF with Liger-Kernel's patch, HF with ours (``cs336_kernels.hf.patch`` and
``attn_implementation="cs336"``).

Each model is built from its config in code (no download): ``llama-3.2-1b`` (Llama-3.2-1B's shape: width 2048, 16
layers, 32 query and 8 key/value heads of 64, MLP 8192, vocabulary 128,256, tied head) and ``qwen3-1.7b`` (Qwen3-1.7B's:
width 2048, 28 layers, 16 and 8 heads of 128 with per-head q/k norms, MLP 6144, vocabulary 151,936, tied head);
``tiny-llama`` and ``tiny-qwen3`` are two-layer versions for a CPU. A step is forward with ``labels`` (the loss),
backward, ``torch.optim.AdamW`` (fused on a GPU) and zeroing the gradients, on ``batch`` documents of ``seq_len``
random tokens, in the model's dtype (bf16 on a GPU: weights, gradients and optimizer state), without a KV cache
(``use_cache=False``). The documents are
``packed`` into one row as ``DataCollatorWithFlattening`` packs them (positions restart at 0 at each document; HF's
SDPA path then builds a block-diagonal causal mask, ours runs the varlen kernel), or ``batched`` as rows of their own
(no mask: SDPA's causal kernel, our dense one).

What each ``impl`` runs:

- ``sdpa``: the model unchanged, ``attn_implementation="sdpa"``; its loss materialises the logits;
- ``liger``: Liger-Kernel's ``apply_liger_kernel_to_<family>(rope, swiglu, rms_norm, fused_linear_cross_entropy)``
  on the model, SDPA attention; needs ``liger_kernel`` (the peers on the GPU machine), skipped with a line saying why
  when it does not import. Liger replaces functions of the family's modeling module for every model, so its rows
  run last;
- ``ours``: ``cs336_kernels.hf.patch(model)`` with ``attn_implementation="cs336"``.

Every impl gets the same weights (one seed) and the same batches. ``warmup`` steps, then ``steps`` timed steps, the
device synchronised around each; with ``profile`` (GPU only), one more step on the last batch under torch.profiler.

    bash tools/gpu.sh python3 -m cs336_harness.cli hf --out writeup/results/hf_step.jsonl

Row fields: ``bench`` ("hf"), ``model``, ``impl``, ``layout``, ``batch``, ``seq_len``, ``tokens`` (per step),
``dtype``, ``status`` (``ok`` or ``oom``), ``step_ms`` (median), ``step_ms_all``, ``tokens_per_s`` (tokens over the
median step), ``peak_gib`` (the CUDA allocator's peak over the timed steps, weights and optimizer state included;
None on a CPU), ``losses`` (every step's loss, warm-up included), ``vs_liger`` (tokens_per_s over the Liger row's of
the same model and layout, when both ran); with ``profile``, ``breakdown``: that step's GPU time by kind of kernel
(:func:`cs336_harness.analysis.kernel_kinds.step_breakdown`).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cs336_harness.analysis import kernel_kinds
from cs336_harness.device import DTYPES, GIB
from cs336_harness.progress import progress_bar
from cs336_harness.studies.fused.common import peer_module

IMPLS: tuple[str, ...] = ("sdpa", "ours", "liger")  # Liger last: its patch changes the modeling modules
LAYOUTS: tuple[str, ...] = ("packed", "batched")

_LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128_256, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 131_072, "tie_word_embeddings": True,
             "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0}}
_QWEN3_17B = {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 40_960, "tie_word_embeddings": True,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}
_TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 1024}
# name -> (model_type, config fields)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": ("llama", _LLAMA_1B),
    "qwen3-1.7b": ("qwen3", _QWEN3_17B),
    "tiny-llama": ("llama", {**_TINY, "tie_word_embeddings": True}),
    "tiny-qwen3": ("qwen3", {**_TINY, "tie_word_embeddings": True}),
}
GPU_MODELS = ("llama-3.2-1b", "qwen3-1.7b")
CPU_MODELS = ("tiny-llama", "tiny-qwen3")


@dataclass(frozen=True)
class HFStepConfig:
    """One run of ``cs336 hf``. The defaults are the GPU's; :meth:`for_device` gives a CPU's."""

    models: tuple[str, ...] = GPU_MODELS
    impls: tuple[str, ...] = IMPLS
    layout: str = "packed"
    batch: int = 4
    seq_len: int = 8192
    dtype: str = "bf16"
    warmup: int = 3
    steps: int = 10
    device: str = "cuda"
    profile: bool = False

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in MODELS]
        if unknown or not self.models:
            raise ValueError(f"models must be among {', '.join(MODELS)}, got {', '.join(self.models) or 'none'}")
        unknown = [i for i in self.impls if i not in IMPLS]
        if unknown or not self.impls:
            raise ValueError(f"impls must be among {', '.join(IMPLS)}, got {', '.join(self.impls) or 'none'}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("batch", "seq_len", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.profile and self.device != "cuda":
            raise ValueError("profile times GPU kernels and needs CUDA; a CPU run has none to time")
        if self.device == "cpu" and self.dtype == "bf16" and "ours" in self.impls:
            raise ValueError("on a CPU our attention runs in Triton's interpreter, which computes bf16 wrongly: "
                             "use --dtype fp32 there")

    @classmethod
    def for_device(cls, cuda: bool, **fields: Any) -> HFStepConfig:
        """The config with this machine's defaults (a CPU: the tiny models, 2 x 16 tokens, fp32, 1 + 2 steps: a
        minute in the interpreter) under the fields given (None: the default)."""
        defaults = {} if cuda else {"models": CPU_MODELS, "batch": 2, "seq_len": 16, "dtype": "fp32", "warmup": 1,
                                    "steps": 2, "device": "cpu"}
        return cls(**{**defaults, **{k: v for k, v in fields.items() if v is not None}})


def build_model(name: str, config: HFStepConfig, attn_implementation: str) -> torch.nn.Module:
    """``name``'s ``*ForCausalLM`` with random weights from a fixed seed, on the config's device and dtype."""
    import transformers

    model_type, fields = MODELS[name]
    # use_cache=False, as training sets it: with a cache HF's mask ignores packed documents (and keeps every key).
    hf_config = transformers.AutoConfig.for_model(model_type, **fields, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation)
    return model.to(config.device, DTYPES[config.dtype]).train()


def impl_model(base: torch.nn.Module, impl: str, model_type: str) -> torch.nn.Module | str:
    """A copy of ``base`` set up as ``impl`` runs it, or why it cannot run here."""
    model = copy.deepcopy(base)
    if impl == "ours":
        import cs336_kernels.hf

        model.set_attn_implementation(cs336_kernels.hf.NAME)
        return cs336_kernels.hf.patch(model)
    if impl == "liger":
        liger, why = peer_module("liger_kernel.transformers")
        if liger is None:
            return why
        try:
            getattr(liger, f"apply_liger_kernel_to_{model_type}")(
                rope=True, swiglu=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=True,
                model=model)
        except Exception as e:  # noqa: BLE001 (a peer that cannot patch this transformers: no rows, a reason)
            return f"Liger-Kernel cannot patch this model: {type(e).__name__}: {e}"
    return model


def batches(config: HFStepConfig, vocab: int) -> list[dict[str, torch.Tensor]]:
    """One batch per step (warm-up included), the same for every impl: ``batch`` documents of ``seq_len`` random
    tokens, packed into one row with restarting positions or batched as rows; labels are the tokens."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(config.warmup + config.steps):
        ids = torch.randint(0, vocab, (config.batch, config.seq_len), generator=gen)
        if config.layout == "packed":
            labels = ids.clone()
            labels[:, 0] = -100  # no target crosses a document boundary (DataCollatorWithFlattening's separator)
            fields = {"input_ids": ids.reshape(1, -1), "labels": labels.reshape(1, -1),
                      "position_ids": torch.arange(config.seq_len).repeat(config.batch)[None]}
        else:
            fields = {"input_ids": ids, "labels": ids.clone()}
        out.append({k: v.to(config.device) for k, v in fields.items()})
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(model: torch.nn.Module, config: HFStepConfig, data: list[dict[str, torch.Tensor]],
            tick: Callable[[], None]) -> dict[str, Any]:
    """The timing fields of one impl's row (module docstring); ``tick`` after each step."""
    cuda = config.device == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(config.device)
        return loss

    losses, times = [], []
    for i, batch in enumerate(data):
        if i == config.warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        _sync(config.device)
        start = time.perf_counter()
        loss = step(batch)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        tick()
    step_s = statistics.median(times[config.warmup:])
    row = {"status": "ok", "step_ms": 1e3 * step_s, "step_ms_all": [1e3 * t for t in times[config.warmup:]],
           "tokens_per_s": config.batch * config.seq_len / step_s,
           "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None, "losses": losses}
    if config.profile:
        row["breakdown"] = kernel_kinds.profiled_breakdown(lambda: step(data[-1]), torch.device(config.device))
    return row


def run_hf_step(config: HFStepConfig, progress: bool = False,
                say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The rows of every (model, impl) of ``config``; ``say`` gets one line for each impl that cannot run here."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but CUDA is not available here")
    steps = config.warmup + config.steps
    bar = progress_bar(total=len(config.models) * len(config.impls) * steps, desc="hf", enabled=progress,
                       unit="step")
    rows = []
    for name in config.models:
        model_type, fields = MODELS[name]
        data = batches(config, fields["vocab_size"])
        base = build_model(name, config, "sdpa")
        for impl in IMPLS:  # in IMPLS' order whatever the config's: Liger last
            if impl not in config.impls:
                continue
            bar.set_postfix_str(f"{name} {impl}")
            row = {"bench": "hf", "model": name, "impl": impl, "layout": config.layout, "batch": config.batch,
                   "seq_len": config.seq_len, "tokens": config.batch * config.seq_len, "dtype": config.dtype}
            model = impl_model(base, impl, model_type)
            if isinstance(model, str):
                say(f"cs336 hf: {name} {impl} not run: {model}")
                bar.update(steps)
                continue
            try:
                row.update(measure(model, config, data, bar.update))
            except torch.OutOfMemoryError:
                row.update({"status": "oom", "step_ms": None, "tokens_per_s": None, "peak_gib": None})
            rows.append(row)
            del model
            if config.device == "cuda":
                torch.cuda.empty_cache()
        del base
    bar.close()
    for row in rows:
        liger = next((r for r in rows if r["model"] == row["model"] and r["impl"] == "liger"), None)
        ok = liger is not None and liger["tokens_per_s"] and row["tokens_per_s"]
        row["vs_liger"] = row["tokens_per_s"] / liger["tokens_per_s"] if ok else None
    return rows
