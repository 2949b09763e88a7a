"""Build writeup/writeup.pdf from writeup/sections/*.md, offline.

Markdown goes to Typst through pandoc (the binary shipped in PyPI's ``pypandoc-binary``), and Typst
compiles the PDF with the fonts bundled in PyPI's ``typst``; both are pinned in the root
pyproject's dev group. System fonts are ignored and Typst packages are refused, so nothing is read
from outside the repository and nothing is downloaded. The timestamp is fixed, so the same sources
give the same PDF byte for byte (CI rebuilds it and fails when the committed copy is stale).

    uv run python tools/build_writeup.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pypandoc
import typst

ROOT = Path(__file__).resolve().parents[1]
WRITEUP = ROOT / "writeup"
SECTIONS = WRITEUP / "sections"
METADATA = WRITEUP / "writeup.yaml"
# The generated Typst source sits one level below writeup/, beside sections/, so the sections'
# figure paths (../figures/NAME.png) resolve the same way for Typst as for a markdown viewer.
TYPST_SOURCE = WRITEUP / "build" / "writeup.typ"
PDF = WRITEUP / "writeup.pdf"
# 2026-12-01T00:00:00Z: a fixed document date keeps the PDF reproducible.
TIMESTAMP = 1_796_083_200
PACKAGE_IMPORT = re.compile(r'#import\s+"@')


def section_files() -> list[Path]:
    """The numbered section files in reading order (``NN-name.md``)."""
    files = sorted(SECTIONS.glob("[0-9][0-9]-*.md"))
    if not files:
        raise FileNotFoundError(f"expected numbered section files NN-name.md in {SECTIONS}, found none")
    return files


def to_typst(files: list[Path]) -> str:
    """Convert the sections to one standalone Typst document with pandoc."""
    args = [
        pypandoc.get_pandoc_path(),
        "--from=markdown",
        "--to=typst",
        "--standalone",
        f"--metadata-file={METADATA}",
        # A pipe table wider than --columns gets equal fixed column widths; a huge value keeps
        # Typst's automatic widths, which fit the widest cell of each column.
        "--columns=100000",
        "--wrap=none",
        *map(str, files),
    ]
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"pandoc failed (exit {result.returncode}):\n{result.stderr}")
    if result.stderr.strip():
        print(result.stderr, file=sys.stderr, end="")
    return result.stdout


def main() -> None:
    source = to_typst(section_files())
    if PACKAGE_IMPORT.search(source):
        raise ValueError("the Typst source imports a package ('#import \"@...'); the build must stay offline")
    TYPST_SOURCE.parent.mkdir(exist_ok=True)
    TYPST_SOURCE.write_text(source)
    typst.compile(
        str(TYPST_SOURCE),
        output=str(PDF),
        root=str(WRITEUP),
        font_paths=[],
        ignore_system_fonts=True,
        timestamp=TIMESTAMP,
    )
    print(f"wrote {PDF.relative_to(ROOT)} from {len(section_files())} sections")


if __name__ == "__main__":
    main()
