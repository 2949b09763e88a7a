"""Our kernels in Hugging Face ``transformers`` (>= 5) models: Llama, Qwen2, Qwen3 and Mistral, any size.

    import cs336_kernels.hf
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)   # or .from_config(config)
    cs336_kernels.hf.patch(model)
    model(input_ids=ids, labels=ids).loss.backward()   # in training mode: no logits materialised

``patch(model)`` changes that model in place, and no other (its modules keep their classes, parameters and state-dict
names; only their ``forward`` is replaced on the instance, which ``copy.deepcopy`` carries over):

- every RMSNorm (each block's two, the final norm, Qwen3's per-head q and k norms): :func:`~cs336_kernels.rms_norm`
  with HF's rounding (``cast_before_weight``), in x's dtype (HF's product takes the weight's dtype when it is wider:
  autocast rounds that back to x's dtype before the next matmul);
- every attention: the projections, Qwen3's q/k norms, :func:`~cs336_kernels.rope` in HF's half-rotated layout on
  the projections' (batch, seq, heads, d) views, the KV cache's update when there is one (generation), then the
  model's attention function (``config._attn_implementation``: ``"cs336"``, ``"sdpa"``, ``"eager"``, ...) with the
  mask and keyword arguments HF gives it;
- every MLP: ``down_proj(silu_mul(gate_proj(x), up_proj(x)))`` (:func:`~cs336_kernels.silu_mul`; the MLP must use
  SiLU);
- the causal-LM head: a forward with ``labels`` in training mode computes the loss with
  :func:`~cs336_kernels.fused_linear_cross_entropy` from the last hidden states (HF's loss: labels shifted left by
  one, or ``shift_labels`` as given; ``ignore_index``; the sum over ``num_items_in_batch`` when given, else the mean)
  and returns ``logits=None``. Without labels, or in eval mode, HF's forward runs and returns the logits.

Importing this module needs ``transformers`` (``pip install cs336-kernels[hf]``); ``cs336_kernels`` itself does not
import it. Tests: ``packages/kernels/tests/test_hf.py`` (tiny random models of each family built in code).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.utils import can_return_tuple
except ImportError as error:
    raise ImportError("cs336_kernels.hf patches Hugging Face transformers models: install cs336-kernels[hf] "
                      "(transformers >= 5)") from error

from cs336_kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from cs336_kernels.ops.rms_norm import rms_norm
from cs336_kernels.ops.rope import rope
from cs336_kernels.ops.swiglu import silu_mul


@dataclass(frozen=True)
class Family:
    """A model family's modeling module, its class-name prefix, and what its attention passes besides the mask."""

    module: types.ModuleType
    prefix: str
    qk_norm: bool  # Qwen3: per-head RMSNorm of q and k before RoPE
    attention_kwargs: Callable[[torch.nn.Module], dict]  # e.g. the sliding window

    def cls(self, suffix: str) -> type:
        return getattr(self.module, f"{self.prefix}{suffix}")


def _own_window(attention: torch.nn.Module) -> dict:
    return {"sliding_window": attention.sliding_window}  # Qwen2, Qwen3: set on sliding-attention layers only


def _config_window(attention: torch.nn.Module) -> dict:
    return {"sliding_window": getattr(attention.config, "sliding_window", None)}  # Mistral


FAMILIES = {
    "llama": Family(modeling_llama, "Llama", False, lambda attention: {}),
    "qwen2": Family(modeling_qwen2, "Qwen2", False, _own_window),
    "qwen3": Family(modeling_qwen3, "Qwen3", True, _own_window),
    "mistral": Family(modeling_mistral, "Mistral", False, _config_window),
}


def _rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, cast_before_weight=True)


def _mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _attention_forward(family: Family) -> Callable:
    eager = family.module.eager_attention_forward

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, ...],
                attention_mask: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The KV cache: `cache` from transformers 5.20 on, `past_key_values` before.
        cache = kwargs.pop("cache", None)
        legacy_cache = kwargs.pop("past_key_values", None)
        cache = legacy_cache if cache is None else cache
        lead = hidden_states.shape[:-1]
        heads = (*lead, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(heads)  # (B, T, Hq, d)
        k = self.k_proj(hidden_states).view(heads)  # (B, T, Hkv, d)
        v = self.v_proj(hidden_states).view(heads)
        if family.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings  # (B or 1, T, d) in the model's dtype
        q, k = rope(q, k, cos, sin, layout="half")
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, d) views, HF's layout
        if cache is not None:  # generation: the cache appends these keys and values and returns all of them
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
        out, weights = attention(self, q.transpose(1, 2), k, v, attention_mask,
                                 dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
                                 **family.attention_kwargs(self), **kwargs)  # out (B, T, Hq, d)
        return self.o_proj(out.reshape(*lead, -1).contiguous()), weights

    return forward


@can_return_tuple
def _causal_lm_forward(self: torch.nn.Module, input_ids: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                       **kwargs) -> CausalLMOutputWithPast:
    labels = kwargs.get("labels")
    if labels is None or not self.training:
        return type(self).forward(self, input_ids, attention_mask, position_ids, **kwargs)
    kwargs.pop("labels")
    if kwargs.pop("logits_to_keep", 0) != 0:
        raise ValueError("the fused loss covers every position: logits_to_keep must be 0 with labels in training")
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    hidden = outputs.last_hidden_state  # (B, T, d)
    # HF's ForCausalLMLoss: token t predicts label t + 1 (or shift_labels as given); the mean over kept tokens, or
    # the sum over num_items_in_batch (gradient accumulation).
    ignore_index = kwargs.get("ignore_index", -100)
    targets = kwargs.get("shift_labels")
    if targets is None:
        targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    num_items = kwargs.get("num_items_in_batch")
    loss = fused_linear_cross_entropy(hidden, self.lm_head.weight, targets.to(hidden.device),
                                      "mean" if num_items is None else "sum", ignore_index)
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if isinstance(num_items, torch.Tensor) else num_items)
    rest = {key: value for key, value in outputs.items() if key != "last_hidden_state"}
    return CausalLMOutputWithPast(loss=loss, logits=None, **rest)


def family_of(model: torch.nn.Module) -> Family:
    """The :class:`Family` of an HF model (by ``config.model_type``); ValueError for a model that is not one."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"cs336_kernels.hf.patch supports Hugging Face models of types {sorted(FAMILIES)}; got "
                         f"{type(model).__name__} with model_type {model_type!r}")
    return FAMILIES[model_type]


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Swap our kernels into a Llama, Qwen2, Qwen3 or Mistral model in place (module docstring) and return it.

    Args:
        model: a ``*ForCausalLM`` or a base ``*Model`` of a supported family (``config.model_type``), any size.

    Returns:
        ``model``, patched. Patching twice changes nothing more.
    """
    family = family_of(model)
    if model.config.hidden_act != "silu":
        raise ValueError(f"the MLP gate is silu_mul: the model must use hidden_act='silu', got "
                         f"{model.config.hidden_act!r}")
    forwards = {family.cls("RMSNorm"): _rms_norm_forward, family.cls("MLP"): _mlp_forward,
                family.cls("Attention"): _attention_forward(family), family.cls("ForCausalLM"): _causal_lm_forward}
    for module in model.modules():
        forward = forwards.get(type(module))
        if forward is None:
            continue
        if type(module) is family.cls("ForCausalLM") and module.lm_head.bias is not None:
            raise ValueError("the fused loss takes a bias-free LM head; this model's lm_head has a bias")
        module.forward = types.MethodType(forward, module)
    return model

