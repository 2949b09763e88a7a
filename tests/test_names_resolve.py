"""Every dotted ``cs336_*`` name that the sources, tests, tools, READMEs and writeup sections mention resolves: its
longest module prefix imports and the rest are attributes of it, so a module moved or renamed cannot leave a stale
name behind in a docstring, a comment or a README. (``writeup/results/attention_notes.md`` is left out: it records
the commands as they ran at the time; so is this file, whose check of the check names stale names on purpose.)"""

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"(?<![\w./-])(cs336_[a-z]+(?:\.[A-Za-z_]\w*)+)")
SOURCES = ("packages/*/src/**/*.py", "packages/*/tests/**/*.py", "tools/*.py", "tests/*.py", "*.md", "*/README.md",
           "packages/*/README.md", "writeup/sections/*.md")


def mentioned(files: list[Path]) -> dict[str, set[str]]:
    """Each dotted name and the files that mention it."""
    found: dict[str, set[str]] = {}
    for path in files:
        for match in NAME.finditer(path.read_text()):
            found.setdefault(match[1], set()).add(path.name)
    return found


def unresolved(name: str) -> str | None:
    """Why ``name`` does not resolve, or None if it does."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and module.startswith(e.name):
                continue  # not a module: try the shorter prefix and attributes
            raise
        for attribute in parts[i:]:
            if not hasattr(obj, attribute):
                return f"{module} has no {attribute!r}"
            obj = getattr(obj, attribute)
        return None
    return f"no module {parts[0]}"


def test_every_mentioned_name_resolves() -> None:
    files = sorted({p for pattern in SOURCES for p in ROOT.glob(pattern)} - {Path(__file__).resolve()})
    found = mentioned(files)
    assert len(found) > 100  # the scan reads what it should
    stale = {name: f"{unresolved(name)} (in {', '.join(sorted(where))})" for name, where in sorted(found.items())
             if unresolved(name)}
    assert stale == {}


def test_the_check_catches_a_stale_name(tmp_path: Path) -> None:
    doc = tmp_path / "README.md"
    doc.write_text("Run ``python -m cs336_harness.attention_tuning``; see `cs336_harness.results.provenance`, "
                   "packages/harness/src/cs336_harness/results.py and cs336_kernels.ops.flash_attention.nope.\n")
    found = mentioned([doc])
    assert sorted(found) == ["cs336_harness.attention_tuning", "cs336_harness.results.provenance",
                             "cs336_kernels.ops.flash_attention.nope"]
    assert unresolved("cs336_harness.attention_tuning") == "cs336_harness has no 'attention_tuning'"
    assert unresolved("cs336_harness.results.provenance") is None
    assert unresolved("cs336_kernels.ops.flash_attention.nope") == "cs336_kernels.ops.flash_attention has no 'nope'"
