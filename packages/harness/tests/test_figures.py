"""What the writeup's figures show: no title drawn over the labels under it, legends as large as axis labels."""

from __future__ import annotations

import matplotlib
import pytest
from cs336_harness.analysis import figures
from matplotlib.text import Text
from test_shard_bench import _gpu_trace

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[matplotlib.figure.Figure]:
    """The figures a plot function draws, kept open instead of closed after saving."""
    kept: list[matplotlib.figure.Figure] = []
    close = plt.close
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    for fig in kept:
        close(fig)


def _long_unit_names(events: list[dict]) -> list[dict]:
    """The hand-made trace with units named like the model's blocks (the names are drawn rotated, so long ones
    reach higher)."""
    rename = {"a": "token_embeddings", "b": "layers.11"}
    unit = lambda name: name.rsplit(".", 1)[0] + "." + rename[name.rsplit(".", 1)[1]]  # noqa: E731
    return [{**e, "name": unit(e["name"]) if e["name"].startswith("fsdp.") else e["name"]} for e in events]


def test_fsdp_zoom_title_clears_the_unit_names(drawn, tmp_path) -> None:
    figures.plot_fsdp_timeline(_long_unit_names(_gpu_trace()), tmp_path / "t.png")
    (fig,) = drawn
    renderer = fig.canvas.get_renderer()
    zoom = fig.axes[1]
    text = zoom.get_title(loc="left")
    title = next(t for t in zoom.get_children() if isinstance(t, Text) and t.get_text() == text)
    title = title.get_window_extent(renderer)
    names = [t for t in zoom.texts if t.get_text()]
    assert [t.get_text() for t in names] == ["token_embeddings", "layers.11"]
    assert all(not title.overlaps(t.get_window_extent(renderer)) for t in names)


def test_collectives_legend_is_as_large_as_the_axis_labels(drawn, tmp_path) -> None:
    rows = [{"op": "all_reduce", "backend": "nccl", "world_size": ws, "bytes": mb * 2**20, "size_mb": mb,
             "busbw_gbps": 10.0 * mb * (ws - 1), "time_ms": 0.1 * mb} for ws in (1, 2) for mb in (1, 10, 100)]
    figures.plot_collectives(rows, tmp_path / "c.png")
    (fig,) = drawn
    bandwidth = fig.axes[0]
    assert [t.get_text() for t in bandwidth.get_legend().get_texts()] == ["nccl, 1 rank", "nccl, 2 ranks"]
    assert all(t.get_fontsize() >= bandwidth.yaxis.label.get_fontsize() for t in bandwidth.get_legend().get_texts())
