"""cs336 shard on CPU (tiny model, two gloo ranks), its trace analysis on a hand-made GPU trace, and its
config checks."""

from __future__ import annotations

import pytest
from cs336_harness.analysis import figures, trace
from cs336_harness.studies import shard as shard_study
from figure_checks import read_figure, read_markdown_table


def _span(name: str, ts: float, dur: float, cat: str = "user_annotation", **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args, "tid": 1}


def _gpu_trace() -> list[dict]:
    """Two layers: a's gather (launched before its forward) ends at 150, before the compute stream is free
    at 200; b's gather ends at 400, after the stream was free at 300, so b waits 100 us."""
    events = [_span("forward", 0, 1000), _span("fsdp.all_gather.a", 5, 5), _span("fsdp.all_gather.b", 20, 5),
              _span("fsdp.forward.a", 30, 20), _span("fsdp.forward.b", 60, 20)]
    # (name, CPU launch time, GPU start, GPU duration)
    kernels = [("warmup_gemm", 1, 100, 100), ("ncclDevKernel_AllGather_RING", 6, 50, 100),
               ("ncclDevKernel_AllGather_RING", 21, 250, 150), ("gemm_a", 35, 200, 100),
               ("gemm_b", 65, 400, 50)]
    for corr, (name, launch, start, dur) in enumerate(kernels):
        events.append(_span("cudaLaunchKernel", launch, 1, cat="cuda_runtime", correlation=corr))
        events.append(_span(name, start, dur, cat="kernel", correlation=corr, stream=7))
    return events


def test_forward_gathers_measure_the_margin_per_layer(tmp_path) -> None:
    gathers = trace.forward_gathers(_gpu_trace())
    assert [g["param"] for g in gathers] == ["a", "b"]
    assert [g["margin_ms"] for g in gathers] == pytest.approx([0.05, -0.1])
    assert trace.gather_summary(_gpu_trace()) == pytest.approx(
        {"fwd_gathers": 2, "fwd_gathers_in_time": 1, "fwd_gather_wait_ms": 0.1})
    fig = read_figure(figures.plot_fsdp_timeline(_gpu_trace(), tmp_path / "t.png"))
    assert (fig.width, fig.height) == (1100, 660) and fig.ink > 0.02
    assert fig.shows("tab:blue", "tab:purple")  # forward compute and the all-gathers


@pytest.fixture(scope="module")
def cpu_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], str]:
    traces = tmp_path_factory.mktemp("shard")
    config = shard_study.ShardBenchConfig(size="tiny", context_length=16, global_batch=2, vocab_size=101,
                                          dtypes=("fp32",), warmup=1, steps=1, backend="gloo")
    return shard_study.run_shard_bench(config, traces), str(traces)


@pytest.mark.slow
def test_cpu_run_accounts_for_each_variant(cpu_rows: tuple[list[dict], str]) -> None:
    rows = {r["variant"]: r for r in cpu_rows[0]}
    assert list(rows) == list(shard_study.VARIANTS)
    ddp, zero1, fsdp, fsdp2 = (rows[v] for v in shard_study.VARIANTS)
    assert zero1["params_gib"] == ddp["params_gib"] and zero1["grads_gib"] == ddp["grads_gib"]
    # Greedy balancing: each rank holds about half of AdamW's two moments (the largest tensor may tip it).
    assert 0.4 < zero1["optim_state_gib"] / ddp["optim_state_gib"] < 0.7
    for sharded in (fsdp, fsdp2):
        assert 0.45 < sharded["params_gib"] / ddp["params_gib"] < 0.6
        assert sharded["grads_gib"] == pytest.approx(sharded["params_gib"])
    assert all(r["step_ms"] > 0 and r["peak_init_gib"] is None for r in rows.values())  # no allocator on CPU
    assert "trace" in fsdp and "trace" in fsdp2 and "trace" not in ddp


@pytest.mark.slow
def test_tables_and_cpu_figure(cpu_rows: tuple[list[dict], str], tmp_path) -> None:
    rows, traces = cpu_rows
    memory_rows = read_markdown_table(shard_study.memory_markdown(rows))
    assert [(r["dtype"], r["wrapper"]) for r in memory_rows] == [("fp32", v) for v in shard_study.VARIANTS]
    assert all(r["peak at init"] == "-" for r in memory_rows)  # no allocator statistics on CPU
    assert set(shard_study.writeup_tables(rows)) == {"shard_memory", "shard_time"}
    time_rows = {r["wrapper"]: r for r in read_markdown_table(shard_study.time_markdown(rows))}
    assert time_rows["fsdp2"]["step / FSDP2 step"] == "1"  # FSDP2 against itself
    assert float(time_rows["fsdp"]["step (ms)"]) == pytest.approx(rows[2]["step_ms"], rel=1e-2)
    fig = read_figure(shard_study.fsdp_timeline_from_rows(rows, traces, "fp32", tmp_path / "fsdp.png"))
    assert fig.ink > 0.02 and fig.shows("tab:blue", "tab:orange")  # CPU ranges: forward units and backward


@pytest.mark.parametrize(("field", "value", "message"), [
    ("size", "huge", "size must be one of"), ("global_batch", 3, "multiple of world_size"),
    ("dtypes", ("fp8",), "dtypes"), ("variants", ("zero3",), "variants"), ("warmup", 0, "warmup >= 1"),
])
def test_config_rejects_bad_values(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shard_study.ShardBenchConfig(**{field: value})
