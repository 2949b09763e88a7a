"""The varlen and window attention benchmarks (``cs336 attention --part varlen / window``): the document lengths, the
masks, each implementation's wiring against a float64 reference (ours and the per-document sum in the interpreter;
FA4's and PyTorch's varlen through stand-ins on CPU; all of them on a GPU), the rows' ratios and skipped rows, the
tables and the CLI flags."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest
import torch
from cs336_harness import cli
from cs336_harness.cli import parse_args
from cs336_harness.studies.attention import attention_flops, causal_attention_flops
from cs336_harness.studies.attention_varlen import (
    VARLEN_IMPLS,
    WINDOW_IMPLS,
    VarlenBenchConfig,
    _compare,
    cu_seqlens_of,
    document_lengths,
    document_mask_mod,
    per_document_forward,
    split_documents,
    unavailable,
    varlen_impl,
    varlen_rows,
    varlen_tables,
    window_impl,
    window_mask_mod,
    window_pairs,
    window_rows,
)
from cs336_kernels import attention_reference, attention_reference_varlen

# Relative Frobenius error against the float64 reference: fp32 in the interpreter; bf16 on a GPU (FlashAttention's
# rule of twice PyTorch's own bf16 error is about this).
FP32_TOL = 1e-5
BF16_TOL = 2e-2
LENGTHS = [13, 1, 20]  # one document of a single token, none a multiple of a tile


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _packed(lengths, heads, heads_kv, d, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    return [torch.randn(total, h, d, dtype=dtype, device=device, generator=gen) for h in (heads, heads_kv, heads_kv,
                                                                                            heads)]


def _reference_varlen(q, k, v, do, lengths):
    """Output and q, k, v gradients of the float64 reference, causal within each document."""
    cu = cu_seqlens_of(lengths, torch.device("cpu"))
    q, k, v = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    out, _ = attention_reference_varlen(q, k, v, cu, cu, True)
    out.backward(do.detach().cpu().double())
    return out, q.grad, k.grad, v.grad


def _assert_matches(got, want, tol, name=""):
    """Output and q, k, v gradients within ``tol`` of the reference's, in relative Frobenius error."""
    for what, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == w.shape, (name, what)
        assert _rel(g.cpu(), w.cpu()) < tol, (name, what, _rel(g.cpu(), w.cpu()))


def _run_per_document(q, k, v, do, lengths):
    """ours_per_document's forward and backward, gathered back into the packed layout."""
    documents = list(zip(*(split_documents(t, lengths) for t in (q, k, v)), strict=True))
    for document in documents:
        for t in document:
            t.requires_grad_()
    outs = per_document_forward(documents)
    torch.autograd.backward(outs, split_documents(do, lengths))

    def packed(ts):
        return torch.cat([t[0].transpose(0, 1) for t in ts])

    return (packed(outs), *(packed([d[i].grad for d in documents]) for i in range(3)))


def _run_packed(impl, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = impl(q, k, v)
    out.backward(do)
    return out, q.grad, k.grad, v.grad


# ------------------------------------------------------------------------------------------ lengths and masks


@pytest.mark.parametrize(("tokens", "shortest", "longest", "seed"), [(32768, 256, 8192, 0), (1000, 7, 300, 3),
                                                                       (97, 97, 97, 1), (5, 256, 8192, 0)])
def test_document_lengths_fill_the_batch_within_the_range(tokens, shortest, longest, seed):
    lengths = document_lengths(tokens, shortest, longest, seed)
    assert sum(lengths) == tokens
    assert all(shortest <= n <= longest for n in lengths[:-1])
    assert 1 <= lengths[-1] <= longest  # the last one cut to fit
    assert document_lengths(tokens, shortest, longest, seed) == lengths


def test_document_lengths_follow_the_seed():
    assert document_lengths(32768, 256, 8192, 0) != document_lengths(32768, 256, 8192, 1)
    assert len(document_lengths(32768, 256, 8192, 0)) >= 4  # 32768 / 8192


@pytest.mark.parametrize("args", [(0, 1, 2, 0), (10, 0, 2, 0), (10, 5, 4, 0)])
def test_document_lengths_reject_bad_ranges(args):
    with pytest.raises(ValueError, match="expected tokens > 0 and 1 <= shortest <= longest"):
        document_lengths(*args)


def test_cu_seqlens_are_int32_cumulative_lengths():
    cu = cu_seqlens_of(LENGTHS, torch.device("cpu"))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 13, 14, 34]


def _grid(mask_mod, n):
    idx = torch.arange(n)
    return mask_mod(0, 0, idx[:, None], idx[None, :])


def test_document_mask_is_causal_within_each_document():
    lengths = [3, 1, 5]
    document = [i for i, n in enumerate(lengths) for _ in range(n)]
    want = torch.tensor([[document[q] == document[kv] and q >= kv for kv in range(9)] for q in range(9)])
    assert torch.equal(_grid(document_mask_mod(lengths, torch.device("cpu")), 9), want)


def test_window_mask_sees_itself_and_the_keys_before_it():
    want = torch.tensor([[0 <= q - kv < 3 for kv in range(7)] for q in range(7)])
    assert torch.equal(_grid(window_mask_mod(3), 7), want)


def test_window_pairs_follow_the_causal_convention():
    assert window_pairs(4096, 4096) == window_pairs(4096, 10**6) == 4096**2 / 2
    assert window_pairs(32768, 4096) == 4096**2 / 2 + (32768 - 4096) * 4096
    assert attention_flops(32, 128, window_pairs(32768, 32768)) == causal_attention_flops(1, 32, 32768, 128)


# ------------------------------------------------------------------------------------- implementations on CPU


def test_ours_and_the_per_document_sum_match_the_reference_in_the_interpreter():
    q, k, v, do = _packed(LENGTHS, 2, 1, 16, torch.float32, torch.device("cpu"))  # grouped-query heads
    want = _reference_varlen(q, k, v, do, LENGTHS)
    ours = _run_packed(varlen_impl("ours", LENGTHS, torch.device("cpu")), q, k, v, do)
    per_document = _run_per_document(q, k, v, do, LENGTHS)
    _assert_matches(ours, want, FP32_TOL, "ours")
    _assert_matches(per_document, want, FP32_TOL, "per document")


def test_per_document_inputs_are_each_documents_own_dense_copy():
    q = torch.randn(sum(LENGTHS), 3, 8)
    parts = split_documents(q.requires_grad_(), LENGTHS)
    assert [p.shape for p in parts] == [(1, 3, n, 8) for n in LENGTHS]
    assert all(p.is_contiguous() and not p.requires_grad for p in parts)
    assert torch.equal(parts[2][0, 1], q[14:34, 1])
    assert len(per_document_forward([])) == 0


def test_fa4_varlen_adapter_passes_the_packed_layout(monkeypatch):
    calls = []

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        calls.append((q.shape, k.shape, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), max_seqlen_q, max_seqlen_k,
                      causal))
        return attention_reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)[0], None

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    q, k, v, do = _packed(LENGTHS, 4, 2, 16, torch.float64, torch.device("cpu"))
    got = _run_packed(varlen_impl("fa4", LENGTHS, torch.device("cpu")), q, k, v, do)
    for g, w in zip(got, _reference_varlen(q, k, v, do, LENGTHS), strict=True):
        torch.testing.assert_close(g, w)
    cu = [0, 13, 14, 34]
    assert calls == [((34, 4, 16), (34, 2, 16), cu, cu, 20, 20, True)]


def test_sdpa_varlen_adapter_asks_for_causal_through_the_window(monkeypatch):
    calls = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size):
        calls.append((max_q, max_k, window_size))
        return attention_reference_varlen(query, key, value, cu_seq_q, cu_seq_k, window_size == (-1, 0))[0]

    fake = types.ModuleType("torch.nn.attention.varlen")
    fake.varlen_attn = varlen_attn
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", fake)
    q, k, v, do = _packed(LENGTHS, 4, 2, 16, torch.float64, torch.device("cpu"))
    got = _run_packed(varlen_impl("sdpa_varlen", LENGTHS, torch.device("cpu")), q, k, v, do)
    for g, w in zip(got, _reference_varlen(q, k, v, do, LENGTHS), strict=True):
        torch.testing.assert_close(g, w)
    assert calls == [(20, 20, (-1, 0))]


def test_fa4_window_adapter_passes_the_window(monkeypatch):
    calls = []

    def flash_attn_func(q, k, v, causal, deterministic, window_size):
        calls.append((q.shape, causal, deterministic, window_size))
        out, _ = attention_reference(*(t.transpose(1, 2) for t in (q, k, v)), causal, window_size=window_size)
        return out.transpose(1, 2), None

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    q, k, v = torch.randn(3, 2, 3, 37, 16, dtype=torch.float64).unbind(0)
    got = window_impl("fa4", 5, 37, torch.device("cpu"))(q, k, v)
    torch.testing.assert_close(got, attention_reference(q, k, v, True, window_size=(4, 0))[0])
    assert calls == [((2, 37, 3, 16), True, False, (4, 0))]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_masks_match_the_reference_forward(monkeypatch):
    # Uncompiled, on CPU, where FlexAttention has no backward: the masks and the packed layout's views.
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    q, k, v, do = _packed(LENGTHS, 4, 2, 16, torch.float64, torch.device("cpu"))
    got = varlen_impl("flex", LENGTHS, torch.device("cpu"))(q, k, v)
    assert _rel(got, _reference_varlen(q, k, v, do, LENGTHS)[0]) < 1e-12
    q, k, v = torch.randn(3, 2, 4, 37, 16, dtype=torch.float64).unbind(0)
    got = window_impl("flex", 5, 37, torch.device("cpu"))(q, k, v)
    assert _rel(got, attention_reference(q, k, v, True, window_size=(4, 0))[0]) < 1e-12


def test_unknown_implementations_are_named():
    with pytest.raises(ValueError, match="varlen_impl takes ours, flex, sdpa_varlen or fa4"):
        varlen_impl("ours_per_document", LENGTHS, torch.device("cpu"))
    with pytest.raises(ValueError, match="window impl must be one of"):
        window_impl("sdpa", 5, 37, torch.device("cpu"))


# ------------------------------------------------------------------------------------------ rows and tables


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"parts": ("anchors",)}, "parts"),
        ({"parts": ()}, "parts"),
        ({"impls": ("ours", "fa3")}, "impls"),
        ({"window_impls": ("sdpa",)}, "window_impls"),
        ({"tokens": 0}, "tokens"),
        ({"window": 0}, "window"),
        ({"rep_ms": 0}, "rep_ms"),
        ({"heads": (32, 7)}, "heads"),
        ({"heads": (32,)}, "heads"),
        ({"head_dim": 8}, "head_dim"),
        ({"doc_lengths": (300, 200)}, "doc_lengths"),
        ({"doc_lengths": (0, 200)}, "doc_lengths"),
        ({"window_shape": (1, 32, 4096)}, "window_shape"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VarlenBenchConfig(**kwargs)


def test_missing_libraries_give_skipped_rows_that_say_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # any import of it fails, as on a machine without FA4
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # as on a torch without the varlen API
    cfg = VarlenBenchConfig(tokens=1000, impls=("fa4", "sdpa_varlen"), window_impls=("fa4",))
    rows = [*varlen_rows(cfg), *window_rows(cfg)]
    assert [(r["bench"], r["impl"], r["status"]) for r in rows] == [
        ("varlen", "sdpa_varlen", "skipped"), ("varlen", "fa4", "skipped"), ("window", "fa4", "skipped")]
    assert rows[0]["note"].startswith(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn")
    assert all(r["note"].startswith("flash_attn.cute is not importable: ") for r in rows[1:])
    assert rows[0]["doc_lengths"] == document_lengths(1000, 256, 8192, 0) and rows[0]["docs"] == len(
        rows[0]["doc_lengths"])
    assert all("fwd_ms" not in r for r in rows)


def test_rows_carry_ours_time_over_each_baselines():
    times = {"ours": (1.0, 3.0, 4.0), "ours_per_document": (2.0, 3.0, 5.0), "flex": (4.0, None, 8.0)}

    def measure(name, inputs):
        assert len(inputs) == 3  # made once, shared
        return dict(zip(("fwd_ms", "bwd_ms", "fwd_bwd_ms"), times[name], strict=True))

    made = []

    def make_inputs():
        made.append(1)
        return (torch.zeros(1),) * 3

    flops = attention_flops(2, 16, 100.0)
    rows = list(_compare({"bench": "varlen"}, list(times), make_inputs, measure, flops))
    assert len(made) == 1
    ours, per_document, flex = rows
    assert ours["status"] == "ok" and "ours_ratio_fwd_bwd" not in ours
    assert ours["fwd_bwd_tflops"] == pytest.approx(flops["fwd_bwd"] / 4e-3 / 1e12)
    assert (per_document["ours_ratio_fwd"], per_document["ours_ratio_bwd"], per_document["ours_ratio_fwd_bwd"]) == (
        0.5, 1.0, 0.8)
    assert per_document["target_ratio"] == 1.05 and flex["target_ratio"] == 0.7
    assert flex["status"] == "oom" and flex["ours_ratio_bwd"] is None and flex["ours_ratio_fwd_bwd"] == 0.5


def test_a_failing_implementation_is_an_error_row_and_the_rest_still_run(capsys):
    def measure(name, inputs):
        if name == "ours":
            raise RuntimeError("no kernel for you")
        return {"fwd_ms": 1.0, "bwd_ms": 1.0, "fwd_bwd_ms": 2.0}

    rows = list(_compare({"bench": "window"}, ["ours", "flex"], lambda: (torch.zeros(1),) * 3, measure,
                         attention_flops(1, 16, 1.0)))
    assert [(r["impl"], r["status"]) for r in rows] == [("ours", "error"), ("flex", "ok")]
    assert rows[0]["error"] == "RuntimeError: no kernel for you"
    assert rows[1]["ours_ratio_fwd_bwd"] is None and rows[1]["target_ratio"] is None
    assert "cs336 attention: window ours failed: RuntimeError: no kernel for you" in capsys.readouterr().err


def _row(bench, impl, call_id, date, fwd_bwd_ms, **extra):
    shape = ({"tokens": 32768, "heads": 32, "heads_kv": 8, "d": 128, "docs": 9, "doc_seed": 0,
              "doc_range": [256, 8192]} if bench == "varlen" else
             {"batch": 1, "heads": 32, "seq": 32768, "d": 128, "window": 4096, "window_size": [4095, 0]})
    return {"bench": bench, "impl": impl, "status": "ok", "fwd_ms": 1.0, "bwd_ms": 2.0, "fwd_bwd_ms": fwd_bwd_ms,
            "fwd_bwd_tflops": 300.0, "call_id": call_id, "date": date, "device": "test-gpu", **shape, **extra}


def test_tables_show_the_latest_call_that_timed_ours_with_ratios():
    rows = [
        _row("varlen", "ours", "old", "2026-01-01", 9.0),
        _row("varlen", "fa4", "new", "2026-01-02", 4.0, ours_ratio_fwd_bwd=1.25, target_ratio=1.0),
        _row("varlen", "ours", "new", "2026-01-02", 5.0),
        _row("varlen", "flex", "old", "2026-01-01", 7.0),
        {**_row("varlen", "sdpa_varlen", "new", "2026-01-02", 0.0), "status": "skipped"},
        _row("window", "fa4", "w", "2026-01-03", 2.0, ours_ratio_fwd_bwd=1.5, target_ratio=1.0),
        _row("window", "ours", "w", "2026-01-03", 3.0),
    ]
    tables = varlen_tables(rows)
    assert set(tables) == {"varlen", "window"}
    assert tables["varlen"].startswith("Packed batch of 32768 tokens in 9 documents (lengths uniform in 256-8192, "
                                       "seed 0), 32 query and 8 key/value heads, d 128, causal, bf16")
    lines = [line.split(" | ")[:4] for line in tables["varlen"].splitlines() if line.startswith("| ours")
             or line.startswith("| fa4") or line.startswith("| flex") or line.startswith("| sdpa")]
    assert lines == [["| ours", "1", "2", "5"], ["| fa4", "1", "2", "4"]]  # ours first; the older call left out
    assert "| fa4 | 1 | 2 | 4 | 300 | - | - | 1.25 | 1 |" in tables["varlen"]
    assert "(b, h, s, d) = (1, 32, 32768, 128)" in tables["window"]
    assert [line.split(" | ")[0] for line in tables["window"].splitlines()[-2:]] == ["| ours", "| fa4"]
    assert varlen_tables([r for r in rows if r["impl"] != "ours"]) == {}


def test_markdown_prints_the_varlen_tables(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (_row("varlen", "ours", "c", "d", 5.0),
                                                          _row("window", "ours", "c", "d", 3.0))))
    assert cli.main(["attention", "--markdown", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Packed batch of 32768 tokens" in out and "Sliding window of 4096 keys" in out


# ----------------------------------------------------------------------------------------------------- CLI


def test_cli_varlen_flags_parse():
    args = parse_args(["attention", "--part", "varlen", "--part", "window", "--varlen-impls", "ours,fa4",
                       "--varlen-heads", "16,4", "--varlen-doc-lengths", "100,200", "--varlen-seed", "3",
                       "--window-shape", "1,8,4096,64", "--window", "512", "--window-impls", "ours,flex"])
    assert args.part == ["varlen", "window"] and args.varlen_impls == ("ours", "fa4")
    assert args.varlen_heads == (16, 4) and args.varlen_doc_lengths == (100, 200) and args.varlen_seed == 3
    assert args.window_shape == (1, 8, 4096, 64) and args.window == 512 and args.window_impls == ("ours", "flex")
    default = parse_args(["attention"])
    assert default.varlen_tokens == 32768 and default.window_shape == (1, 32, 32768, 128)


@pytest.mark.parametrize(("argv", "said"), [
    (["--varlen-heads", "32,7"], "heads must be (query heads, key/value heads)"),
    (["--varlen-doc-lengths", "1,2,3"], "doc_lengths must be (shortest, longest)"),
    (["--varlen-impls", "ours,fa3"], "impls must be a non-empty subset of"),
])
def test_cli_bad_varlen_flags_are_one_clear_line(argv, said):
    with pytest.raises(SystemExit, match=re.escape(f"cs336 attention: {said}")):
        cli.main(["attention", "--part", "varlen", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_cli_varlen_on_cpu_says_it_needs_a_gpu():
    with pytest.raises(SystemExit, match="cs336 attention: the attention benchmarks time GPU kernels and need a CUDA"):
        cli.main(["attention", "--part", "varlen", "--quick"])


# ------------------------------------------------------------------------------------------------------ GPU


def _skip_unless_available(name, bench):
    why_not = unavailable(name, bench)
    if why_not is not None:
        pytest.skip(why_not)


@pytest.mark.gpu
@pytest.mark.parametrize("name", VARLEN_IMPLS)
def test_each_varlen_implementation_matches_the_reference_on_the_gpu(name):
    _skip_unless_available(name, "varlen")
    lengths = document_lengths(1000, 17, 300, 5)
    device = torch.device("cuda")
    q, k, v, do = _packed(lengths, 8, 2, 128, torch.bfloat16, device)
    want = _reference_varlen(q, k, v, do, lengths)
    got = (_run_per_document(q, k, v, do, lengths) if name == "ours_per_document"
           else _run_packed(varlen_impl(name, lengths, device), q, k, v, do))
    _assert_matches(got, want, BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("name", WINDOW_IMPLS)
def test_each_window_implementation_matches_the_reference_on_the_gpu(name):
    _skip_unless_available(name, "window")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(1, 4, 1000, 128, dtype=torch.bfloat16, device=device, generator=gen)
                   for _ in range(4))
    got = _run_packed(window_impl(name, 300, 1000, device), q, k, v, do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = attention_reference(q64, k64, v64, True, window_size=(299, 0))
    out.backward(do.double())
    _assert_matches(got, (out, q64.grad, k64.grad, v64.grad), BF16_TOL)
