"""Tables from result rows: fixed-width text for the terminal, markdown for the writeup, filled between markers.

A writeup section holds ``<!-- table:NAME -->`` ... ``<!-- /table:NAME -->``; :func:`fill_tables`
replaces the table between them with a freshly generated one, so numbers in the text are never typed
by hand; a caption paragraph (``: ...``) after the table, inside the markers, stays.
``tools/writeup_tables.py`` builds the writeup's tables this way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _cell(value: Any, floatfmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return format(value, floatfmt)
    return str(value).replace("|", "\\|")


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], floatfmt: str = ".3f") -> str:
    """A fixed-width text table of ``columns`` from ``rows`` (missing values shown as '-')."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return format(v, floatfmt)
        return str(v)

    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def columns_with_values(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> tuple[list[str], list[str]]:
    """``columns`` split in two: those with a value (not None) in some row, and those empty in every row."""
    filled = [c for c in columns if any(r.get(c) is not None for r in rows)]
    return filled, [c for c in columns if c not in filled]


def markdown_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str | tuple[str, str]], floatfmt: str = ".3g"
) -> str:
    """A GitHub-markdown table; a column is a key or a ``(key, header)`` pair; missing values show '-'."""
    if not columns:
        raise ValueError("markdown_table needs at least one column")
    keys = [c if isinstance(c, str) else c[0] for c in columns]
    headers = [c if isinstance(c, str) else c[1] for c in columns]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(k), floatfmt) for k in keys) + " |")
    return "\n".join(lines)


# A pandoc table caption (a paragraph opening with ": ") that closes a marked block belongs to the prose, not to the
# generated table, so filling keeps it.
_CAPTION = re.compile(r"\n\n(: [^\n]+(?:\n[^\n]+)*)\n$")


def fill_tables(text: str, tables: Mapping[str, str]) -> str:
    """Replace the table in every ``<!-- table:NAME -->`` block in ``text`` whose NAME is in ``tables``, keeping a
    caption paragraph (``: ...``) that ends the block.

    Raises:
        ValueError: if a NAME in ``tables`` has no marker pair in ``text``.
    """
    for name, table in tables.items():
        pattern = re.compile(rf"(<!-- table:{re.escape(name)} -->\n)(.*?)(<!-- /table:{re.escape(name)} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no '<!-- table:{name} -->' ... '<!-- /table:{name} -->' block in the text")

        def fill(m: re.Match[str], table: str = table) -> str:
            caption = _CAPTION.search(m.group(2))
            return m.group(1) + table + ("\n\n" + caption.group(1) if caption else "") + "\n" + m.group(3)

        text = pattern.sub(fill, text)
    return text


def print_or_fill(tables: Mapping[str, str], section: str | Path | None) -> None:
    """Print ``tables`` (marker name -> markdown), or, given a ``section`` file, rewrite its marked blocks.

    Raises:
        ValueError: if the section cannot be read or lacks a table's markers.
    """
    if section is None:
        print(*tables.values(), sep="\n\n")
        return
    path = Path(section)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read the section {str(path)!r}: {e.strerror or e}") from None
    path.write_text(fill_tables(text, tables))
