"""Regenerate the writeup's tables (and with --figures its figures) from writeup/results/: the command over
``writeup_tables.py`` (beside it), which holds every table.

    uv run python tools/harness_tables.py            # rewrite the sections' tables in place
    uv run python tools/harness_tables.py --print    # print the tables instead
    uv run python tools/harness_tables.py --figures  # also re-render the figures in writeup/figures/
"""

from __future__ import annotations

import argparse

import writeup_tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the tables instead of rewriting the sections")
    parser.add_argument("--figures", action="store_true", help="also re-render the figures in writeup/figures/")
    args = parser.parse_args()
    built = writeup_tables.build_tables()
    if args.print:
        for section, tables in built.items():
            for name, table in tables.items():
                print(f"## {section}/{name}\n{table}\n")
    else:
        for path in writeup_tables.fill_sections(built):
            print(f"wrote {len(built[path.name[:2]])} tables into {path.relative_to(writeup_tables.ROOT)}")
    if args.figures:
        for path in writeup_tables.render_figures():
            print(f"wrote {path.relative_to(writeup_tables.ROOT)}")


if __name__ == "__main__":
    main()
