"""Markdown tables and marker filling."""

from __future__ import annotations

import pytest
from cs336_harness.analysis.tables import fill_tables, markdown_table


def test_markdown_table_formats_and_escapes() -> None:
    rows = [{"a": 1.234, "b": "x|y", "c": True}, {"a": None}]
    assert markdown_table(rows, ["a", ("b", "B"), "c"], floatfmt=".2f") == (
        "| a | B | c |\n|---|---|---|\n| 1.23 | x\\|y | yes |\n| - | - | - |")


def test_fill_tables_replaces_only_the_named_block() -> None:
    text = "x\n<!-- table:t -->\nold\n<!-- /table:t -->\n<!-- table:u -->\nkeep\n<!-- /table:u -->\n"
    out = fill_tables(text, {"t": "NEW"})
    assert out == "x\n<!-- table:t -->\nNEW\n<!-- /table:t -->\n<!-- table:u -->\nkeep\n<!-- /table:u -->\n"
    assert fill_tables(out, {"t": "NEW"}) == out
    with pytest.raises(ValueError, match="table:v"):
        fill_tables(text, {"v": "x"})


def test_fill_tables_keeps_the_caption_that_ends_a_block() -> None:
    text = "<!-- table:t -->\n| a |\n|---|\n| 1 |\n\n: The caption,\non two lines.\n<!-- /table:t -->\n"
    out = fill_tables(text, {"t": "| a |\n|---|\n| 2 |"})
    assert out == "<!-- table:t -->\n| a |\n|---|\n| 2 |\n\n: The caption,\non two lines.\n<!-- /table:t -->\n"
    assert fill_tables(out, {"t": "| a |\n|---|\n| 2 |"}) == out
    # A table that is not followed by a caption gets none.
    assert fill_tables("<!-- table:t -->\nold\n<!-- /table:t -->", {"t": "NEW"}) == (
        "<!-- table:t -->\nNEW\n<!-- /table:t -->")
