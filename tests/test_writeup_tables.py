"""The writeup's tables (``tools/writeup_tables.py``) are the ones its sections hold: every table between markers is
what the committed rows build, so a number in a table cannot drift from its rows; and the leaderboard's MFU is
computed from a row's shape and step time against the ceiling of the GPU the row names."""


import pytest
from cs336_basics.config import ModelConfig
from cs336_harness.analysis.tables import fill_tables
from cs336_harness.studies.leaderboard.flops import step_flops
from tool_modules import load_tool

writeup = load_tool("writeup_tables")


def test_the_sections_hold_the_tables_the_rows_build() -> None:
    for section, tables in writeup.build_tables().items():
        (path,) = (writeup.ROOT / "writeup" / "sections").glob(f"{section}-*.md")
        text = path.read_text()
        assert fill_tables(text, tables) == text, f"{path.name} is stale: uv run python tools/harness_tables.py"


def test_row_mfu_counts_model_flops_against_the_rows_gpu() -> None:
    shape = {"d_model": 64, "d_ff": 256, "num_layers": 2, "num_heads": 4, "vocab_size": 37, "context_length": 9}
    flops = step_flops(ModelConfig(**shape), 3)
    row = {**shape, "global_batch": 3, "world_size": 2, "step_s": 0.25, "device": "2x NVIDIA H200",
           "model_flops_per_step": 2 * flops, "mfu": 0.9}  # what a row stores is not read
    assert writeup.model_flops(row) == flops
    assert writeup.row_mfu(row) == pytest.approx(flops / (0.25 * 2 * 772e12))
    assert writeup.row_mfu({**row, "device": "NVIDIA H200"}) == writeup.row_mfu(row)
    assert writeup.row_mfu({**row, "device": "2x NVIDIA A100-SXM4-80GB"}) is None


def test_anchor_tables_leave_out_rows_of_a_change_not_kept(monkeypatch) -> None:
    """A call that timed a kernel change beside the kept kernels marks the change's rows with ``variant``; the
    tables show the kept kernels whatever the order of the rows."""

    def row(impl: str, ms: float, **extra) -> dict:
        return {"bench": "anchors", "impl": impl, "batch": 1, "heads": 2, "seq": 64, "d": 64, "status": "ok",
                "fwd_ms": ms / 3, "bwd_ms": 2 * ms / 3, "fwd_bwd_ms": ms, "fwd_bwd_tflops": 1.0, "call_id": "c2",
                **extra}

    timed = [row("ours", 1.0), row("sdpa", 2.0), row("fa4", 0.5), row("ours", 9.0, variant="tried, not kept")]
    monkeypatch.setattr(writeup, "rows", lambda name: timed if name == "attention_anchors" else [])
    assert "| 1 |" in writeup.table_anchors() and "| 9 |" not in writeup.table_anchors()
    assert "| 1 | 2 | 0.5 | 2 |" in writeup.table_anchors_fa4()


def test_fa4_table_shows_ours_as_its_call_ran_them_when_a_later_change_replaced_them(monkeypatch) -> None:
    """The call that timed FA4 may have timed only kernels replaced since (their rows carry ``variant``): the FA4
    table still compares them, while the anchors table takes ours from the call of the kept kernels."""

    def row(impl: str, ms: float, call_id: str, **extra) -> dict:
        return {"bench": "anchors", "impl": impl, "batch": 1, "heads": 2, "seq": 64, "d": 64, "status": "ok",
                "fwd_ms": ms / 3, "bwd_ms": 2 * ms / 3, "fwd_bwd_ms": ms, "fwd_bwd_tflops": 1.0, "call_id": call_id,
                **extra}

    timed = [row("ours", 1.0, "c1"), row("sdpa", 2.0, "c1"),
             row("ours", 3.0, "c2", variant="replaced"), row("sdpa", 2.0, "c2"), row("fa4", 0.5, "c2")]
    monkeypatch.setattr(writeup, "rows", lambda name: timed if name == "attention_anchors" else [])
    assert "| 3 | 2 | 0.5 | 6 |" in writeup.table_anchors_fa4()
    assert "| 1 |" in writeup.table_anchors() and "| 3 |" not in writeup.table_anchors()


def test_tables_take_each_shape_and_op_from_the_latest_call_that_timed_ours(monkeypatch) -> None:
    """A later call whose ours rows at a shape are a change not kept, or whose ours failed at an op, leaves that
    shape's or op's line to the call before it."""

    def anchor(impl: str, ms: float, d: int, call_id: str, **extra) -> dict:
        return {"bench": "anchors", "impl": impl, "batch": 1, "heads": 2, "seq": 64, "d": d, "status": "ok",
                "fwd_ms": ms / 3, "bwd_ms": 2 * ms / 3, "fwd_bwd_ms": ms, "fwd_bwd_tflops": 1.0, "call_id": call_id,
                **extra}

    def glue(impl: str, call_id: str, date: str, **times) -> dict:
        return {"bench": "glue", "op": "rope", "part": "fwd+bwd", "impl": impl, "call_id": call_id, "date": date,
                **times}

    anchors = [anchor("ours", 1.0, 64, "c1"), anchor("sdpa", 2.0, 64, "c1"), anchor("ours", 3.0, 128, "c1"),
               anchor("ours", 9.0, 64, "c2", variant="not kept"), anchor("sdpa", 8.0, 64, "c2"),
               anchor("ours", 4.0, 128, "c2")]
    kernels = [glue("ours", "k1", "2026-01-01", ms=0.75, vs_copy=0.5), glue("copy", "k1", "2026-01-01", ms=0.5),
               glue("ours", "k2", "2026-01-02", error="OutOfMemoryError"), glue("copy", "k2", "2026-01-02", ms=0.4)]
    monkeypatch.setattr(writeup, "rows", lambda name: {"attention_anchors": anchors, "kernel_limits": kernels}[name])
    table = writeup.table_anchors()
    assert "| 1 |" in table and "| 2 |" in table and "| 4 |" in table
    assert not any(f"| {ms} |" in table for ms in (3, 8, 9))
    assert "| rope | do_bench | 0.75 |" in writeup.table_glue() and "0.4" not in writeup.table_glue()
