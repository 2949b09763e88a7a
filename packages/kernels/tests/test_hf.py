"""cs336_kernels.hf on tiny random Llama, Qwen2, Qwen3 and Mistral models built in code (no downloads): the patched
model with attn_implementation="cs336" against the unpatched one with SDPA (the loss, the logits and every
parameter's gradient, 20 AdamW steps, greedy generation), packed batches (DataCollatorWithFlattening) and padded ones
against their documents run alone, and the inputs the attention refuses.

On CPU the kernels run in Triton's interpreter in fp32 (conftest.py); the GPU tests run bf16 at larger sizes and
hold the patched model to FlashAttention's error rule: its error against an fp32 reference at most twice the
unpatched bf16 model's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from cs336_kernels.ops.flash_attention import attention_reference

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("cs336_kernels.hf")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# ||patched - unpatched|| / ||unpatched|| in fp32: both compute the same function, rounded differently (fp32 RoPE
# and RMSNorm in one kernel each, the loss from chunked logits).
FP32_REL_TOL = 2e-5
# FlashAttention's rule for 16-bit runs (bf16 weights, or autocast): the patched model's error against the fp32 model
# at most this many times the unpatched one's.
ERROR_RATIO = 2.0
BF16_ROUNDING = 2.0**-8  # bf16's unit roundoff: the relative error of one rounding at most
VOCAB = 97


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """A two-layer model of ``family`` with awkward sizes: 5 query heads of 16 over one key/value head (24 over 2 for
    Qwen3), width 80, MLP 88."""
    common = {"vocab_size": VOCAB, "hidden_size": 80, "intermediate_size": 88, "num_hidden_layers": 2,
              "num_attention_heads": 5, "num_key_value_heads": 1, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6}
    # The overrides go to the constructor, which derives fields from them (Qwen's layer_types has one entry a layer).
    configs = {
        "llama": lambda: transformers.LlamaConfig(**{**common, "tie_word_embeddings": True, **overrides}),  # tied head
        "qwen2": lambda: transformers.Qwen2Config(**{**common, **overrides}),  # q, k and v projections with a bias
        "qwen3": lambda: transformers.Qwen3Config(**{**common, "num_attention_heads": 4, "num_key_value_heads": 2,
                                                     "head_dim": 24, **overrides}),  # per-head q/k norms
        "mistral": lambda: transformers.MistralConfig(**{**common, "sliding_window": 5, **overrides}),  # < the batch
    }
    return configs[family]()


def build(family: str, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32, seed: int = 0,
          **overrides) -> torch.nn.Module:
    """A randomly initialised ``*ForCausalLM`` (weights scaled up so that the blocks change the residual stream)."""
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))  # norms that are not the identity
            else:
                param.normal_(0, 0.3 if param.dim() == 1 else 1.5 / param.shape[-1] ** 0.5)
    return model.to(DEVICE, dtype).train()


def batch(seq: int, rows: int = 2, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    labels = ids.clone()
    labels[:, ::4] = -100  # ignored targets
    return ids.to(DEVICE), labels.to(DEVICE)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels, **kwargs).loss
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


def patched_copy(model: torch.nn.Module, attn_implementation: str = "cs336") -> torch.nn.Module:
    patched = hf.patch(copy.deepcopy(model))
    patched.set_attn_implementation(attn_implementation)
    return patched


# The quick run (-m "not slow") keeps one case of each kind of check, each a model forward and backward in the
# interpreter (seconds): Qwen3 here (the family with the most sites: its q/k norms), Llama packed.
@pytest.mark.parametrize("family", [f if f == "qwen3" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_patched_model_matches_unpatched_fp32(family):
    reference = build(family)
    patched = patched_copy(reference)
    ids, labels = batch(seq=11)
    want_loss, want_grads = loss_and_grads(reference, ids, labels)
    loss, grads = loss_and_grads(patched, ids, labels)
    assert patched(input_ids=ids, labels=labels).logits is None  # training with labels: no logits
    assert _rel_err(loss, want_loss) < FP32_REL_TOL
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert _rel_err(grad, want_grads[name]) < FP32_REL_TOL, (name, _rel_err(grad, want_grads[name]))
    for model in (reference, patched):
        model.eval()
    with torch.no_grad():
        logits, want_logits = patched(input_ids=ids).logits, reference(input_ids=ids).logits
        eval_loss = patched(input_ids=ids, labels=labels).loss  # eval mode: HF's loss from the logits
    assert _rel_err(logits, want_logits) < FP32_REL_TOL
    assert _rel_err(eval_loss, want_loss) < FP32_REL_TOL


@pytest.mark.slow
def test_patch_works_with_any_attention():
    # The patch leaves the attention function to the config: here HF's SDPA after our RoPE.
    reference = build("qwen2")
    ids, labels = batch(seq=7)
    want_loss, want_grads = loss_and_grads(reference, ids, labels)
    loss, grads = loss_and_grads(patched_copy(reference, "sdpa"), ids, labels)
    assert _rel_err(loss, want_loss) < FP32_REL_TOL
    assert all(_rel_err(grads[n], g) < FP32_REL_TOL for n, g in want_grads.items())


@pytest.mark.parametrize("family", ["gemma2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_attention_alone_in_a_family_patch_does_not_cover(family):
    # attn_implementation="cs336" without patch(): Gemma-2 passes its logit softcap, query_pre_attn_scalar's scaling
    # and a sliding window on alternate layers; Gemma-3 its per-layer sliding and full attention. Against HF's eager
    # attention (the one Gemma-2's softcap runs on).
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 88, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
              "sliding_window": 5, "query_pre_attn_scalar": 24}
    config = (transformers.Gemma2Config(**common, attn_logit_softcapping=20.0) if family == "gemma2" else
              transformers.Gemma3TextConfig(**common, layer_types=["sliding_attention", "full_attention"]))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(DEVICE).train()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3 if param.dim() == 1 else 1.5 / param.shape[-1] ** 0.5)
    ids, labels = batch(24)  # longer than the window
    ref_loss, ref_grads = loss_and_grads(model, ids, labels)
    ours = copy.deepcopy(model)
    ours.set_attn_implementation("cs336")
    loss, grads = loss_and_grads(ours, ids, labels)
    assert _rel_err(loss, ref_loss) <= FP32_REL_TOL
    assert all(_rel_err(grads[name], ref_grads[name]) <= FP32_REL_TOL for name in grads)


@pytest.mark.slow
def test_under_autocast_as_trainer_runs_it():
    # fp32 weights under autocast (Trainer's bf16=True; fp16 here, which the interpreter computes right): the head's
    # matmul and the attention run in autocast's dtype, as HF's own forward has them.
    reference = build("llama")
    patched = patched_copy(reference)
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    # The rule on the losses of four batches, a tensor as FlashAttention applies it to: one batch's loss is a scalar
    # whose reference error can be near zero by chance (HF's came within 5e-5 of the fp32 loss on one CPU). The
    # gradients, tensors already, on the first batch.
    exact_losses, hf_losses, losses = [], [], []
    for seed in range(1, 5):
        ids, labels = batch(seq=9, seed=seed)
        exact_loss, exact_grads = loss_and_grads(reference, ids, labels)
        with torch.autocast(DEVICE, dtype=dtype):
            hf_loss, hf_grads = loss_and_grads(reference, ids, labels)
            loss, grads = loss_and_grads(patched, ids, labels)
        assert all(g.dtype == torch.float32 for g in grads.values())
        if seed == 1:
            for name, exact in exact_grads.items():
                assert _rel_err(grads[name], exact) <= ERROR_RATIO * _rel_err(hf_grads[name], exact), name
        exact_losses.append(exact_loss)
        hf_losses.append(hf_loss)
        losses.append(loss)
    exact = torch.stack(exact_losses)
    assert _rel_err(torch.stack(losses), exact) <= ERROR_RATIO * _rel_err(torch.stack(hf_losses), exact)


def test_patch_replaces_every_kernel_site_and_keeps_the_state_dict():
    model = build("qwen3")
    names = dict(model.state_dict())
    hf.patch(model)
    patched = [name for name, module in model.named_modules() if "forward" in vars(module)]
    kinds = {type(module).__name__ for name, module in model.named_modules() if "forward" in vars(module)}
    assert kinds == {"Qwen3RMSNorm", "Qwen3Attention", "Qwen3MLP", "Qwen3ForCausalLM", "Linear"}
    # 2 layers x (2 norms + q_norm + k_norm + attention + MLP), the final norm, the causal LM and its head.
    assert len(patched) == 2 * 6 + 3 and "lm_head" in patched
    assert model.state_dict().keys() == names.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in names.items())


def _trainable_step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(("order", "targets"), [
    ("patch_then_lora", "blocks"), ("lora_then_patch", "blocks"), ("patch_then_lora", "head"),
    pytest.param("lora_then_patch", "head", marks=pytest.mark.slow),
    pytest.param("patch_then_lora", "head_saved", marks=pytest.mark.slow)])
def test_lora_adapters_on_a_patched_model(order, targets):
    # PEFT's LoRA wraps the projections the patched forwards call, before or after patch(): the adapters' gradients
    # (the only trainable ones) match LoRA on the unpatched model. An adapter on the head (LoRA, or modules_to_save's
    # trained copy) computes more than the head's weight product: HF's loss from the logits, never the fused loss.
    peft = pytest.importorskip("peft")
    model = build("qwen3")
    sites = {"blocks": ["q_proj", "v_proj", "gate_proj", "down_proj"], "head": ["q_proj", "lm_head"],
             "head_saved": ["q_proj"]}[targets]
    config = peft.LoraConfig(r=4, target_modules=sites, lora_dropout=0.0, init_lora_weights=False,  # random B
                             modules_to_save=["lm_head"] if targets == "head_saved" else None)
    torch.manual_seed(2)
    reference = peft.get_peft_model(copy.deepcopy(model), config)
    if order == "patch_then_lora":
        ours = peft.get_peft_model(patched_copy(model), config)
    else:
        ours = hf.patch(peft.get_peft_model(copy.deepcopy(model), config))
        ours.base_model.model.set_attn_implementation("cs336")
    ours.load_state_dict(reference.state_dict())
    ids, labels = batch(16)
    (ref_out, ref_grads), (out, grads) = (_trainable_step(lora, ids, labels) for lora in (reference, ours))
    # A and B of each site in each of 2 layers (the head's once); modules_to_save trains a copy of the head.
    expected = {"blocks": 2 * 4 * 2, "head": 2 * 2 + 2, "head_saved": 2 * 2 + 1}[targets]
    assert len(grads) == expected and grads.keys() == ref_grads.keys()
    assert (out.logits is None) == (targets == "blocks")
    assert _rel_err(out.loss, ref_out.loss) <= FP32_REL_TOL
    assert all(_rel_err(grads[name], ref_grads[name]) <= FP32_REL_TOL for name in grads)


def test_with_gradient_checkpointing():
    # Trainer's gradient_checkpointing=True: HF recomputes each block in the backward, our kernels inside it.
    reference = build("llama")
    ids, labels = batch(16)
    want_loss, want_grads = loss_and_grads(reference, ids, labels)
    model = patched_copy(reference)
    if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
        model.activation_checkpointing_enable()
        assert model.is_activation_checkpointing
    else:
        model.gradient_checkpointing_enable()
        assert model.is_gradient_checkpointing
    loss, grads = loss_and_grads(model, ids, labels)
    assert _rel_err(loss, want_loss) <= FP32_REL_TOL
    assert all(_rel_err(grads[name], want_grads[name]) <= FP32_REL_TOL for name in want_grads)


@pytest.mark.parametrize("order", ["patch_then_shard", "shard_then_patch"])
def test_under_fsdp2_with_the_head_sharded_on_its_own(order):
    # fully_shard on each block, on the head alone (untied: Qwen2 here) and on the root: the fused loss runs as the
    # head's forward, so FSDP2 gathers the head's weight for it and for its backward; patch finds the modules FSDP2
    # gave classes of their own. One rank: every parameter a DTensor all the same.
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    reference = build("qwen2")
    ids, labels = batch(16)
    ref_out, ref_grads = _trainable_step(reference, ids, labels)
    model = copy.deepcopy(reference)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        if order == "patch_then_shard":
            hf.patch(model)
        for block in (*model.model.layers, model.lm_head, model):
            fully_shard(block)
        if order == "shard_then_patch":
            hf.patch(model)
        model.set_attn_implementation("cs336")
        out, grads = _trainable_step(model, ids, labels)
        grads = {name: grad.full_tensor() for name, grad in grads.items()}
    finally:
        dist.destroy_process_group()
    assert out.logits is None  # the fused loss ran
    assert _rel_err(out.loss, ref_out.loss) <= FP32_REL_TOL
    assert grads.keys() == ref_grads.keys()
    assert all(_rel_err(grads[name], ref_grads[name]) <= FP32_REL_TOL for name in grads)


@pytest.mark.slow
def test_loss_follows_hf_kwargs():
    # num_items_in_batch (gradient accumulation: the sum over that many tokens) and shift_labels as HF's loss takes.
    reference = build("llama")
    patched = patched_copy(reference)
    ids, labels = batch(seq=9)
    shift = torch.roll(labels, -1, dims=1)
    for kwargs in ({"num_items_in_batch": torch.tensor(7, device=DEVICE)}, {"shift_labels": shift}):
        want, want_grads = loss_and_grads(reference, ids, labels, **kwargs)
        got, grads = loss_and_grads(patched, ids, labels, **kwargs)
        assert _rel_err(got, want) < FP32_REL_TOL, kwargs
        assert all(_rel_err(grads[n], g) < FP32_REL_TOL for n, g in want_grads.items()), kwargs


@pytest.mark.slow
def test_return_dict_false_and_generation_with_a_cache():
    reference = build("mistral").eval()
    patched = patched_copy(reference)
    ids, labels = batch(seq=6, rows=1)
    patched.train()
    loss = patched(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(loss, tuple) and loss[0].dim() == 0
    patched.eval()
    with torch.no_grad():  # greedy decoding: our RoPE, the cache's update, attention over the cache (bottom-right)
        want = reference.generate(ids, max_new_tokens=4, do_sample=False)
        got = patched.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_twenty_adamw_steps_follow_the_same_loss_curve(family):
    reference = build(family)
    patched = patched_copy(reference)
    ids, labels = batch(seq=10, seed=100)  # one batch, learnt over the steps
    curves = []
    for model in (reference, patched):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(20):
            optimizer.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        curves.append(torch.tensor(losses, dtype=torch.float64))
    want, got = curves
    assert want[-1] < want[0]  # the curve the patched model must follow is one that learns
    assert ((got - want).abs() / want).max() < 1e-4


@pytest.mark.slow
def test_trainer_with_packed_batches_and_gradient_accumulation(tmp_path):
    # transformers.Trainer as a user runs it: DataCollatorWithFlattening packs documents of uneven lengths into one
    # row (position_ids), two micro-batches a step (the loss summed over num_items_in_batch), three steps.
    pytest.importorskip("accelerate")  # Trainer's dependency (peft brings it)
    reference = build("qwen3")
    gen = torch.Generator().manual_seed(0)
    documents = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()}
                 for n in (9, 5, 12, 7, 3, 10, 8, 6)]
    curves = []
    for model in (copy.deepcopy(reference), patched_copy(reference)):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
            learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=DEVICE == "cpu", save_strategy="no", seed=0,
            disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=documents,
                                       data_collator=transformers.DataCollatorWithFlattening())
        trainer.train()
        curves.append(torch.tensor([log["loss"] for log in trainer.state.log_history if "loss" in log]))
    want, got = curves
    assert len(want) == 3 and want[-1] < want[0]
    assert ((got - want).abs() / want).max() < 1e-4


def test_rejects_what_it_cannot_patch():
    with pytest.raises(ValueError, match=r"model_type 'gpt2'"):
        hf.patch(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)))
    with pytest.raises(ValueError, match="hidden_act='silu', got 'gelu'"):
        hf.patch(build("llama", hidden_act="gelu"))
    model = hf.patch(build("llama"))
    ids, labels = batch(seq=5)
    with pytest.raises(ValueError, match="logits_to_keep must be 0"):
        model(input_ids=ids, labels=labels, logits_to_keep=1)


# Packed and padded batches through attn_implementation="cs336".
DOCUMENTS = [7, 1, 12, 5]  # token counts, one a single token; Mistral's window of 5 cuts into the longer ones


def _documents(seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in DOCUMENTS]


def _alone(model: torch.nn.Module, documents: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each document run by itself: its logits, concatenated, and the gradient of its summed loss."""
    model.zero_grad(set_to_none=True)
    logits = []
    for doc in documents:
        ids = torch.tensor([doc], device=DEVICE)
        out = model(input_ids=ids)
        logits.append(out.logits[0])
        if len(doc) > 1:
            torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:], reduction="sum").backward()
    grad = model.get_input_embeddings().weight.grad.clone()
    return torch.cat(logits).detach(), grad


@pytest.mark.parametrize(("family", "kwargs"), [
    ("llama", "position_ids"),
    pytest.param("mistral", "flash_attn_kwargs", marks=pytest.mark.slow),  # the window within each document
    pytest.param("qwen3", "position_ids", marks=pytest.mark.slow),
    pytest.param("qwen2", "flash_attn_kwargs", marks=pytest.mark.slow),
])
def test_packed_batch_equals_its_documents_alone(family, kwargs):
    # DataCollatorWithFlattening's rows: documents one after another, positions restarting at 0; with
    # return_flash_attn_kwargs also cu_seq_lens_q/k and max_length_q/k. Eval mode: logits for every token.
    model = patched_copy(build(family)).eval()
    documents = _documents()
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=kwargs == "flash_attn_kwargs")
    packed = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
              for k, v in collator([{"input_ids": doc} for doc in documents]).items()}
    labels = packed.pop("labels")  # -100 at each document's first token: no target crosses a boundary
    model.zero_grad(set_to_none=True)
    logits = model(**packed).logits[0]
    torch.nn.functional.cross_entropy(logits[:-1], labels[0, 1:], reduction="sum").backward()
    grad = model.get_input_embeddings().weight.grad.clone()
    want_logits, want_grad = _alone(model, documents)
    assert _rel_err(logits.detach(), want_logits) < FP32_REL_TOL
    assert _rel_err(grad, want_grad) < FP32_REL_TOL


@pytest.mark.parametrize("family", ["llama", pytest.param("mistral", marks=pytest.mark.slow)])
def test_padded_batch_equals_its_documents_alone(family):
    # Right and left padding in one batch: the padding mask reaches the attention, which unpads, runs the packed
    # batch and pads again.
    model = patched_copy(build(family)).eval()
    documents = _documents()[:3]
    width = max(map(len, documents))
    ids = torch.zeros(len(documents), width, dtype=torch.long)
    mask = torch.zeros(len(documents), width, dtype=torch.long)
    rows = []
    for i, doc in enumerate(documents):
        cols = slice(width - len(doc), width) if i % 2 else slice(0, len(doc))  # odd rows padded on the left
        ids[i, cols], mask[i, cols] = torch.tensor(doc), 1
        rows.append(cols)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE),
                       position_ids=position_ids.to(DEVICE)).logits
        for i, doc in enumerate(documents):
            alone = model(input_ids=torch.tensor([doc], device=DEVICE)).logits[0]
            assert _rel_err(logits[i, rows[i]], alone) < FP32_REL_TOL, i


def test_attention_refuses_what_it_cannot_run():
    model = patched_copy(build("llama"))
    ids, labels = batch(seq=6)
    with pytest.raises(ValueError, match="4-D mask"):
        model(input_ids=ids, attention_mask=torch.ones(2, 1, 6, 6, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="or_mask_function"):
        hf.padding_mask(2, 6, 6, use_vmap=True)
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="no attention dropout"):
        model(input_ids=ids, labels=labels)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_attention_knobs_match_the_reference(packed):
    # scaling, sliding_window and softcap as HF passes them, against the materialised reference in float64: a window
    # of 4 is `window_size=(3, 0)` with the causal diagonal.
    module = torch.nn.Module()
    module.is_causal = True
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, heads, 9, 16, generator=gen).to(DEVICE) for heads in (4, 2, 2))  # HF's (B, H, T, d)
    knobs = {"scaling": 0.3, "sliding_window": 4, "softcap": 2.5}
    kwargs = {"position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]] * 2, device=DEVICE)} if packed else {}
    out, weights = hf.attention_forward(module, q, k, v, None, **knobs, **kwargs)
    assert weights is None and out.shape == (2, 9, 4, 16)
    reference = {"softmax_scale": 0.3, "window_size": (3, 0), "softcap": 2.5}
    pieces = [(slice(0, 5), slice(0, 5)), (slice(5, 9), slice(5, 9))] if packed else [(slice(0, 9), slice(0, 9))]
    for rows_q, rows_k in pieces:
        want, _ = attention_reference(q[:, :, rows_q].double(), k[:, :, rows_k].double(),
                                      v[:, :, rows_k].double(), True, **reference)
        assert _rel_err(out[:, rows_q], want.transpose(1, 2)) < FP32_REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_within_flash_attentions_error_rule_on_gpu(family):
    # A larger model in bf16: every output of the patched model (cs336 attention) within twice the unpatched bf16
    # model's (SDPA) error against the unpatched model in fp32: the loss, the logits and every parameter's gradient.
    sizes = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 2, "vocab_size": 4099, "max_position_embeddings": 4096}
    if family == "qwen3":
        sizes["head_dim"] = 128
    fp32 = build(family, **sizes)
    bf16 = copy.deepcopy(fp32).bfloat16()
    patched = patched_copy(bf16)
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 4099, (2, 1024), generator=gen).to(DEVICE)
    labels = ids.clone()
    results = {}
    for name, model in (("fp32", fp32), ("hf", bf16), ("ours", patched)):
        loss, grads = loss_and_grads(model, ids, labels)
        with torch.no_grad():
            model.eval()
            logits = model(input_ids=ids).logits
            model.train()
        results[name] = {"loss": loss, "logits": logits, **grads}
    # The loss, one mean, takes FlashAttention's floor of one rounding to bf16 besides: its rounding errors cancel, so
    # the unpatched model's can fall far below a rounding by chance, and twice that is no bound. Every tensor is held
    # to twice the unpatched model's error alone.
    errors = {key: (_rel_err(results["ours"][key], exact), _rel_err(results["hf"][key], exact))
              for key, exact in results["fp32"].items()}
    over = {key: err for key, err in errors.items()
            if err[0] > ERROR_RATIO * err[1] + (BF16_ROUNDING if key == "loss" else 0.0)}
    assert not over, over
