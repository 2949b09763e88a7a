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


def test_fsdp_timeline_draws_no_text_over_a_panel(drawn, tmp_path) -> None:
    """The legend stands above the whole-step panel, the titles clear both panels, and nothing is written inside
    them; the text is as large as the axis labels."""
    figures.plot_fsdp_timeline(_gpu_trace(), tmp_path / "t.png", title="a step")
    (fig,) = drawn
    renderer = fig.canvas.get_renderer()
    top, zoom = fig.axes
    panels = [ax.get_window_extent(renderer) for ax in (top, zoom)]
    zoom_title = next(t for t in zoom.get_children() if isinstance(t, Text) and t.get_text() == zoom.get_title("left"))
    legend, (suptitle,) = top.get_legend(), fig.texts
    over = [legend.get_window_extent(renderer), suptitle.get_window_extent(renderer),
            zoom_title.get_window_extent(renderer)]
    assert zoom_title.get_text().endswith("1 waited")
    assert not any(box.overlaps(panel) for box in over for panel in panels)
    assert not top.texts and not zoom.texts
    assert all(t.get_fontsize() >= figures.LABEL_SIZE for t in [*legend.get_texts(), zoom_title, suptitle])


def test_collectives_legend_is_as_large_as_the_axis_labels(drawn, tmp_path) -> None:
    rows = [{"op": "all_reduce", "backend": "nccl", "world_size": ws, "bytes": mb * 2**20, "size_mb": mb,
             "busbw_gbps": 10.0 * mb * (ws - 1), "time_ms": 0.1 * mb} for ws in (1, 2) for mb in (1, 10, 100)]
    figures.plot_collectives(rows, tmp_path / "c.png")
    (fig,) = drawn
    bandwidth = fig.axes[0]
    assert [t.get_text() for t in bandwidth.get_legend().get_texts()] == ["nccl, 1 rank", "nccl, 2 ranks"]
    assert all(t.get_fontsize() >= bandwidth.yaxis.label.get_fontsize() for t in bandwidth.get_legend().get_texts())
