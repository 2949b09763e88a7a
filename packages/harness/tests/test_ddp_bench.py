"""``cs336 ddp`` and ``cs336 collectives`` on CPU: well-formed rows, tables and figures; overlap arithmetic."""

from __future__ import annotations

import pytest
from cs336_harness import cli
from cs336_harness.analysis import trace
from cs336_harness.instrument import STEP_PHASES
from cs336_harness.results import read_rows
from cs336_harness.studies import ddp as ddp_study
from cs336_harness.studies.collectives import collectives_markdown
from figure_checks import read_figure, read_markdown_table


def _kernel(name: str, ts: float, dur: float, stream: int) -> dict:
    return {"cat": "kernel", "ph": "X", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_comm_overlap_counts_only_uncovered_nccl_time() -> None:
    events = [
        _kernel("gemm", 0.0, 100.0, 7),
        _kernel("elementwise", 150.0, 50.0, 7),
        _kernel("ncclDevKernel_AllReduce", 80.0, 40.0, 21),
        _kernel("ncclDevKernel_AllReduce", 110.0, 20.0, 21),  # overlaps the previous: union 80..130
        _kernel("ncclDevKernel_AllReduce", 190.0, 30.0, 21),
    ]
    got = trace.comm_overlap(events)
    assert got["comm_ms"] == pytest.approx(0.080)
    assert got["exposed_comm_ms"] == pytest.approx(0.050)  # 100..130 and 200..220 have no compute
    assert got["gpu_span_ms"] == pytest.approx(0.220)
    assert trace.comm_overlap([])["comm_ms"] is None


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="multiple of world_size"):
        ddp_study.DDPBenchConfig(size="tiny", global_batch=3, world_size=2)
    with pytest.raises(ValueError, match="variants"):
        ddp_study.DDPBenchConfig(size="tiny", variants=("fsdp",))
    with pytest.raises(ValueError, match="size"):
        ddp_study.DDPBenchConfig(size="huge")


@pytest.mark.slow
def test_ddp_command_on_cpu(tmp_path, capsys) -> None:
    out, figs = tmp_path / "ddp.jsonl", tmp_path / "figs"
    assert cli.main(["ddp", "--size", "tiny", "--context-length", "16", "--warmup", "1", "--steps", "2",
                     "--variants", "nocomm,naive,bucketed,torch_ddp", "--bucket-size-mb", "0.05",
                     "--out", str(out), "--figure-dir", str(figs)]) == 0
    rows = read_rows(out)
    assert [r["variant"] for r in rows] == ["nocomm", "naive", "bucketed", "torch_ddp"]
    for r in rows:
        assert r["backend"] == "gloo" and r["world_size"] == 2 and r["step_ms"] > 0 and "commit" in r
        assert r["params_in_sync"] == (r["variant"] != "nocomm")
        host = [r[f"host_{phase}_ms"] for phase in STEP_PHASES]
        assert all(h > 0 for h in host)
        # The sync tail lies inside the step: from the backward's last gradient to the end of the sync.
        assert 0 <= r["sync_tail_ms"] <= r["step_max_ms"] and r["sync_tail_share"] == r["sync_tail_ms"] / r["step_ms"]
        # Per step the smallest tail over the ranks: never above the slowest rank's, and never negative.
        assert 0 <= r["comm_tail_ms"] <= r["sync_tail_ms"] and r["comm_tail_share"] == r["comm_tail_ms"] / r["step_ms"]
    fig = read_figure(figs / "ddp_timeline_fp32.png")
    assert fig.ink > 0.02 and fig.shows("tab:blue", "tab:orange", "tab:red", "tab:green")  # the four CPU phases
    table = read_markdown_table(ddp_study.ddp_markdown(rows))
    assert [(r["dtype"], r["wrapper"]) for r in table] == [(r["dtype"], r["variant"]) for r in rows]
    assert [r["replicas equal"] for r in table] == ["no" if r["variant"] == "nocomm" else "yes" for r in rows]


@pytest.mark.slow
def test_collectives_command_on_cpu(tmp_path) -> None:
    out, plot = tmp_path / "coll.jsonl", tmp_path / "coll.png"
    assert cli.main(["collectives", "--backends", "gloo", "--world-sizes", "2", "--sizes-mb", "0.01,0.1",
                     "--warmup", "1", "--iters", "2", "--out", str(out), "--plot", str(plot)]) == 0
    rows = read_rows(out)
    assert len(rows) == 6
    fig = read_figure(plot)
    assert (fig.width, fig.height) == (1210, 1056) and fig.shows("tab:blue")  # 3 ops x 2 panels, one series
    (line,) = read_markdown_table(collectives_markdown(rows))
    assert (line["backend"], line["ranks"]) == ("gloo", "2") and "GB/s" in line["0.1 MiB"]


def test_last_gradient_is_the_first_layer_of_a_stack() -> None:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x = torch.randn(5, 3)
    last = ddp_study._last_gradient(lambda: model(x).sum().backward(), list(model.parameters()))
    assert last is model[0].weight or last is model[0].bias  # backward reaches the first layer last
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # the counting hooks are removed
    with pytest.raises(ValueError, match="no gradient"):
        ddp_study._last_gradient(lambda: None, list(model.parameters()))
