"""What a test can read back from a figure or a markdown table: the image's size, how much of it is drawn, which
series colours appear; a table's rows as dicts. Tests check what a figure shows, not how many bytes it has."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# matplotlib's default "tab" colours, the ones our figures use for their series.
TAB = {"tab:blue": "#1f77b4", "tab:orange": "#ff7f0e", "tab:green": "#2ca02c", "tab:red": "#d62728",
       "tab:purple": "#9467bd", "tab:gray": "#7f7f7f"}


@dataclass(frozen=True)
class Figure:
    width: int
    height: int
    ink: float  # fraction of pixels that are not the white background
    pixels: np.ndarray  # (H, W, 3) uint8

    def count(self, color: str, tol: int = 8) -> int:
        """Pixels within ``tol`` per channel of ``color`` (a ``tab:`` name or ``#rrggbb``)."""
        hexcode = TAB.get(color, color).lstrip("#")
        rgb = np.array([int(hexcode[i : i + 2], 16) for i in (0, 2, 4)], dtype=np.int16)
        return int((np.abs(self.pixels.astype(np.int16) - rgb) <= tol).all(axis=-1).sum())

    def shows(self, *colors: str, min_pixels: int = 40) -> bool:
        """Whether every colour fills at least ``min_pixels`` pixels (a series drawn, not an anti-aliased edge)."""
        return all(self.count(c) >= min_pixels for c in colors)


def read_figure(path: str | Path) -> Figure:
    import matplotlib.image

    image = matplotlib.image.imread(str(path))  # (H, W, 3 or 4) floats in [0, 1]
    rgb = (image[..., :3] * 255).round().astype(np.uint8)
    ink = float((rgb < 250).any(axis=-1).mean())
    return Figure(width=rgb.shape[1], height=rgb.shape[0], ink=ink, pixels=rgb)


def read_markdown_table(text: str) -> list[dict[str, str]]:
    """The rows of the first GitHub-markdown table in ``text``, keyed by its header cells."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("|")]
    if len(lines) < 2 or not set(lines[1]) <= set("|-: "):
        raise ValueError("no markdown table (a header line and a |---| line) in the text")
    split = lambda line: [c.strip() for c in line.strip("|").split("|")]  # noqa: E731
    header = split(lines[0])
    return [dict(zip(header, split(line), strict=True)) for line in lines[2:]]
