"""Our kernels in Hugging Face ``transformers`` (>= 5.4) models: Llama, Qwen2, Qwen3 and Mistral, any size.

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
  and returns ``logits=None``. Without labels, or in eval mode, HF's forward runs and returns the logits. The loss
  runs as the head module's forward (hooks on the head, such as FSDP2's where the head is sharded on its own, run
  around it). A head that is not a bias-free ``torch.nn.Linear`` when patched, or that is wrapped or replaced after
  (PEFT's LoRA or ``modules_to_save``, ``resize_token_embeddings``), keeps HF's loss from the logits.

``patch`` works on a model sharded by FSDP2's ``fully_shard`` as on one that is not (either order).

Under autocast (fp32 weights, Trainer's ``bf16=True``) the LM head's matmul and the attention take autocast's dtype,
as HF's own forward has them (our operators are not autocast ops, so the casts are explicit).

Importing this module also registers our attention as ``attn_implementation="cs336"`` (any model whose attention
goes through ``transformers.AttentionInterface``, patched or not), and its mask function under the same name in
``AttentionMaskInterface``: a model whose implementation has no mask function gets no mask at all, so padding would
be silently dropped. What it runs, for HF's (batch, heads, seq, d) q, k, v:

- a padding mask (2-D, from ``attention_mask``): the tokens it keeps are gathered into a packed batch (unpadded),
  run by :func:`~cs336_kernels.flash_attention_varlen` and scattered back, zeros at padded queries (HF's
  flash-attention path does the same);
- packed documents, no mask (``DataCollatorWithFlattening``): ``cu_seq_lens_q/k`` and ``max_length_q/k`` as the
  collator passes them, or else documents read from ``position_ids`` (one starts wherever a position is not its
  predecessor's plus one, as HF's packed-sequence mask has it), into the varlen kernel;
- otherwise :func:`~cs336_kernels.flash_attention` on the dense batch (causal aligned bottom-right, so decoding with
  a KV cache works too);

with the module's ``scaling``, ``sliding_window`` (a key at most ``sliding_window - 1`` tokens back) and ``softcap``.
Masks HF builds from custom mask functions (``or_mask_function`` / ``and_mask_function``) or passes as 4-D tensors are
refused with a ValueError, never dropped; so is attention dropout.

Importing this module needs ``transformers`` (``pip install cs336-kernels[hf]``); ``cs336_kernels`` itself does not
import it. Tests: ``packages/kernels/tests/test_hf.py`` (tiny random models of each family built in code).
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from cs336_kernels.ops.flash_attention import flash_attention, flash_attention_varlen
from cs336_kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from cs336_kernels.ops.rms_norm import rms_norm
from cs336_kernels.ops.rope import rope
from cs336_kernels.ops.swiglu import silu_mul

# The oldest release the tests pass on (the hf extra's lower bound): before it HF's mask functions and Cache.update
# take other arguments, which would fail deep inside a forward.
OLDEST_TRANSFORMERS = "5.4"

try:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers import __version__ as transformers_version
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.utils import can_return_tuple
except ImportError as error:
    raise ImportError(f"cs336_kernels.hf patches Hugging Face transformers models: install cs336-kernels[hf] "
                      f"(transformers >= {OLDEST_TRANSFORMERS})") from error


def _minor(version: str) -> tuple[int, int]:
    return tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", version).groups())


if _minor(transformers_version) < _minor(OLDEST_TRANSFORMERS):
    raise ImportError(f"cs336_kernels.hf needs transformers >= {OLDEST_TRANSFORMERS}, found {transformers_version}: "
                      "install cs336-kernels[hf] to upgrade it")


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


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` in autocast's dtype where autocast is on (our operators are not autocast ops), else as they are."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


def _rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, cast_before_weight=True)


def _mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _attention_forward(family: Family) -> Callable:
    eager = family.module.eager_attention_forward

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, ...],
                attention_mask: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The KV cache: `cache` in recent transformers 5 releases (5.25), `past_key_values` in older ones (5.17).
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


def _head_forward(self: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor | None = None,
                  reduction: str = "mean", ignore_index: int = -100) -> torch.Tensor:
    """The LM head: its product as before (``targets`` None), or the fused loss of ``hidden`` against ``targets``
    without the logits. The loss runs as the head's forward so that hooks on the head run around it: FSDP2's, where
    the head is sharded on its own, gather its weight before and again for the backward."""
    if targets is None:
        return F.linear(hidden, self.weight)
    hidden, weight = _autocast(hidden, self.weight)  # as autocast runs the head's matmul (Trainer's bf16=True)
    return fused_linear_cross_entropy(hidden, weight, targets, reduction, ignore_index)


def _is_patched(module: torch.nn.Module, forward: Callable) -> bool:
    own = vars(module).get("forward")
    return isinstance(own, types.MethodType) and own.__func__ is forward


@can_return_tuple
def _causal_lm_forward(self: torch.nn.Module, input_ids: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                       **kwargs) -> CausalLMOutputWithPast:
    labels = kwargs.get("labels")
    # A head that is not ours, as PEFT's LoRA or modules_to_save wrap it or resize_token_embeddings replaces it: HF's
    # loss (from the logits), which covers whatever the head computes.
    if labels is None or not self.training or not _is_patched(self.lm_head, _head_forward):
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
    loss = self.lm_head(hidden, targets.to(hidden.device), "mean" if num_items is None else "sum", ignore_index)
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if isinstance(num_items, torch.Tensor) else num_items)
    rest = {key: value for key, value in outputs.items() if key != "last_hidden_state"}
    return CausalLMOutputWithPast(loss=loss, logits=None, **rest)


def _model_class(module: torch.nn.Module) -> type:
    """The module's class, or where FSDP2 has sharded it (``fully_shard`` gives it a class of its own, ``FSDPModule``
    and the module's), the class it had before."""
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


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
        forward = forwards.get(_model_class(module))
        if forward is None:
            continue
        head = module.lm_head if forward is _causal_lm_forward else None
        if head is not None and _model_class(head) is torch.nn.Linear and head.bias is None:
            head.forward = types.MethodType(_head_forward, head)
        module.forward = types.MethodType(forward, module)
    return model



# The attention registered as "cs336".
NAME = "cs336"


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                   use_vmap: bool = False, **kwargs) -> torch.Tensor | None:
    """The mask function registered as "cs336" in ``AttentionMaskInterface``: None when no key is padded (the
    causal diagonal, a sliding window and packed documents are the attention's own), else the (batch, kv_length)
    bool padding mask. HF asks for ``use_vmap`` only when a model adds its own mask functions, which the kernels
    cannot express."""
    if use_vmap:
        raise ValueError("attn_implementation='cs336' runs causal, sliding-window, padded and packed attention; this "
                         "model adds its own mask function (or_mask_function / and_mask_function): use 'sdpa'")
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]  # a sliding window's cache keeps the last keys
    # No padding: the dense kernel (this reads the mask: one host sync, as HF's flash-attention mask has).
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def _documents(position_ids: torch.Tensor, batch: int) -> tuple[torch.Tensor, int] | None:
    """cu_seqlens (int32) and the longest document of rows packed with several documents each, read from their
    position_ids; None when every row is one document."""
    positions = position_ids.expand(batch, -1)
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    if int(starts.sum()) == batch:  # one document per row (a host sync, as HF's packed-sequence check has)
        return None
    cu_seqlens = F.pad(starts.flatten().nonzero().flatten().to(torch.int32), (0, 1), value=positions.numel())
    return cu_seqlens, int(cu_seqlens.diff().max())


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """The attention registered as "cs336" in ``AttentionInterface`` (module docstring).

    Args:
        module: the model's attention module (``is_causal`` read from it unless given).
        query: (batch, heads_q, seq_q, d); key, value: (batch, heads_kv, seq_k, d), HF's layout.
        attention_mask: what :func:`padding_mask` returned: None or a (batch, seq_k) bool padding mask.
        dropout: must be 0.
        scaling, sliding_window, softcap: the module's (None: 1 / sqrt(d), no window, no cap).
        kwargs: HF's packed-batch kwargs (``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids``); others are
            ignored.

    Returns:
        (output (batch, seq_q, heads_q, d), None): no attention weights.
    """
    if dropout:
        raise ValueError(f"attn_implementation='cs336' has no attention dropout; got dropout={dropout} (set the "
                         f"config's attention_dropout to 0)")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attn_implementation='cs336' takes a 2-D padding mask; got a {attention_mask.dim()}-D mask "
                         f"of shape {tuple(attention_mask.shape)} (a prepared or custom mask: use 'sdpa')")
    query, key, value = _autocast(query, key, value)  # HF's RoPE leaves q and k in fp32 under autocast
    causal = module.is_causal if is_causal is None else is_causal
    knobs = {"softmax_scale": scaling, "softcap": softcap or 0.0,
             "window_size": (sliding_window - 1, -1) if sliding_window else (-1, -1)}
    batch, heads_q, seq_q, head_dim = query.shape
    seq_k = key.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, T, H, d)
    if attention_mask is not None:  # padding: unpad, run the packed batch, pad again
        keep_k = attention_mask.flatten().nonzero().flatten()
        keep_q = attention_mask[:, -seq_q:].flatten().nonzero().flatten()
        lengths_k = attention_mask.sum(-1, dtype=torch.int32)
        lengths_q = attention_mask[:, -seq_q:].sum(-1, dtype=torch.int32)
        out = flash_attention_varlen(
            q.reshape(batch * seq_q, heads_q, head_dim)[keep_q], k.reshape(batch * seq_k, -1, head_dim)[keep_k],
            v.reshape(batch * seq_k, -1, head_dim)[keep_k], F.pad(lengths_q.cumsum(0, dtype=torch.int32), (1, 0)),
            F.pad(lengths_k.cumsum(0, dtype=torch.int32), (1, 0)), int(lengths_q.max()), int(lengths_k.max()),
            causal=causal, **knobs)
        padded = out.new_zeros(batch * seq_q, heads_q, head_dim).index_put((keep_q,), out)
        return padded.view(batch, seq_q, heads_q, head_dim), None
    packed = None
    if kwargs.get("cu_seq_lens_q") is not None:  # DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        packed = (kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32),
                  int(kwargs["max_length_q"]), int(kwargs["max_length_k"]))
    elif kwargs.get("position_ids") is not None and seq_q == seq_k:  # documents told by their positions alone
        documents = _documents(kwargs["position_ids"], batch)
        if documents is not None:
            packed = (documents[0], documents[0], documents[1], documents[1])
    if packed is not None:
        out = flash_attention_varlen(q.reshape(batch * seq_q, heads_q, head_dim),
                                     k.reshape(batch * seq_k, -1, head_dim), v.reshape(batch * seq_k, -1, head_dim),
                                     *packed, causal=causal, **knobs)
        return out.view(batch, seq_q, heads_q, head_dim), None
    out = flash_attention(query, key, value, causal, **knobs)  # in query's layout
    return out.transpose(1, 2), None


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, padding_mask)
