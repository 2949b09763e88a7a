"""Results rows with provenance, appended to JSON-lines files, and plain-text tables.

Every measured number in the repo lives in a row that says what was run (command), where (device),
with what (torch and triton versions), from which commit and when. Tables and figures are made
from these rows: :func:`read_rows_of` reads the rows of one command's kind (:class:`RowKind`) from files that may
hold others.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_REPO_ROOT = Path(__file__).resolve().parents[4]
# The GPU machine receives a copy of the working tree whose .git is missing or stale (it can hold the
# session's first commit); a post-commit hook (tools/install-hooks.sh) keeps the current commit in this
# untracked file so rows there still say it.
_COMMIT_FILE = _REPO_ROOT / ".commit"
_CLI = Path(__file__).resolve().with_name("cli.py")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=_REPO_ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str:
    """The commit the code ran from, with ``+dirty`` if tracked files were modified.

    Where ``.commit`` names another commit than git's HEAD, or there is no git of this tree's own (the GPU
    machine's copy, a tree staged inside another checkout), it is read from ``.commit`` and marked ``+unchecked``.
    """
    # A tree staged inside another checkout (tools/stage_base.sh's .base) sees that checkout's git: not its own.
    toplevel = _git("rev-parse", "--show-toplevel")
    own_git = toplevel is not None and Path(toplevel).resolve() == _COMMIT_FILE.parent.resolve()
    commit = _git("rev-parse", "--short=12", "HEAD") if own_git else None
    recorded = _COMMIT_FILE.read_text().strip() if _COMMIT_FILE.exists() else None
    if commit and recorded in (None, commit):
        return commit + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")
    return f"{recorded}+unchecked" if recorded else "unknown"


def device_name() -> str:
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"{n}x {torch.cuda.get_device_name(0)}" if n > 1 else torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()})"


def command_line(argv: Sequence[str]) -> str:
    """``argv`` as a user types it from the repository root: ``cs336 ...`` for the CLI (its entry point, or its module
    run as ``python -m cs336_harness.cli``), ``uv run python PATH ...`` for a Python script, with each absolute path
    inside the repository made relative to it and each inside ``$OUT`` (the GPU machine's output folder) written as
    ``$OUT/...``, so that a row names no folder of the machine that ran it."""
    if not argv:
        return ""
    head, *args = argv
    if head.endswith("cs336") or Path(head).resolve() == _CLI:
        words = ["cs336"]
    elif head.endswith(".py"):
        words = ["uv", "run", "python", _word(head)]
    else:
        words = [_word(head)]
    return " ".join([*words, *map(_word, args)])


def portable_path(path: str | Path) -> str:
    """``path`` as a row names it: relative to the repository inside it, ``$OUT/...`` inside ``$OUT`` (the GPU
    machine's output folder), else as given."""
    text = str(path)
    if not text.startswith("/"):
        return text
    resolved = Path(text).resolve()
    out = os.environ.get("OUT")
    if resolved.is_relative_to(_REPO_ROOT):
        return str(resolved.relative_to(_REPO_ROOT))
    if out and resolved.is_relative_to(Path(out).resolve()):
        rest = str(resolved.relative_to(Path(out).resolve()))
        return "$OUT" + ("/" + rest if rest != "." else "")
    return text


def _word(arg: str) -> str:
    """One shell word of :func:`command_line`: :func:`portable_path` of an absolute path, also as the value of
    ``--flag=PATH``."""
    flag, value = arg.split("=", 1) if arg.startswith("-") and "=" in arg else ("", arg)
    prefix = flag + "=" if flag else ""
    portable = portable_path(value)
    if portable.startswith("$OUT"):  # $OUT stays a variable for the shell to expand
        return (shlex.quote(prefix) if prefix else "") + "$OUT" + (shlex.quote(portable[4:]) if portable[4:] else "")
    return shlex.quote(prefix + portable)


def provenance(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What every results row carries: command (:func:`command_line` of ``argv``, default ``sys.argv``), device,
    versions, commit, UTC date, and the call id shared by the rows of one call on the GPU machine (``CS336_CALL_ID``,
    set by ``tools/gpu.sh``; None elsewhere)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    argv = list(sys.argv if argv is None else argv)
    return {
        "command": command_line(argv),
        "device": device_name(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "call_id": os.environ.get("CS336_CALL_ID"),
    }


def _file_in_the_way(folder: Path) -> Path | None:
    """The first of ``folder`` and the folders above it that is a file, where making ``folder`` would fail with
    "File exists" or "Not a directory"; None if there is none."""
    return next((p for p in (*reversed(folder.parents), folder) if p.exists() and not p.is_dir()), None)


def check_writable(path: str | Path) -> Path:
    """``path`` as a Path, once a file can be appended there (its folder made if missing), so a run whose output
    cannot be written fails before it starts rather than after.

    Raises:
        ValueError: if the folder cannot be made (a file in the way is named) or the file cannot be opened for
            appending.
    """
    path = Path(path)
    existed = path.exists()
    blocker = _file_in_the_way(path.parent)
    if blocker is not None:
        raise ValueError(f"cannot write to {str(path)!r}: {str(blocker)!r} is a file, not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except OSError as e:
        raise ValueError(f"cannot write to {str(path)!r}: {e.strerror or e}") from None
    if not existed:
        path.unlink()
    return path


def check_writable_dir(path: str | Path) -> Path:
    """``path`` as a Path, once files can be made in it (made if missing), so a run fails before it starts rather
    than when it writes there.

    Raises:
        ValueError: if the folder cannot be made (a file in the way is named) or a file in it cannot be written,
            naming the folder.
    """
    path = Path(path)
    blocker = _file_in_the_way(path)
    if blocker is not None:
        raise ValueError(f"cannot write to the folder {str(path)!r}: {str(blocker)!r} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"cannot write to the folder {str(path)!r}: {e.strerror or e}") from None
    return path


def append_rows(path: str | Path, rows: Iterable[dict[str, Any]], meta: dict[str, Any] | None = None) -> Path:
    """Append each row, merged with ``meta`` (default: :func:`provenance`), as one JSON line; the lines are
    written in one call and the file closed, so they are whole on disk when this returns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = provenance() if meta is None else meta
    lines = "".join(json.dumps({**row, **meta}) + "\n" for row in rows)
    with path.open("a") as f:
        f.write(lines)
    return path


@dataclass(frozen=True)
class RowWriter:
    """Appends a study's rows to ``path`` as each of its runs finishes (:func:`append_rows`), so a run that fails
    later keeps what was measured before it. Picklable, so a spawned rank writes too; the provenance is taken
    once, where the writer is made (:meth:`to`)."""

    path: Path
    meta: dict[str, Any]

    @classmethod
    def to(cls, path: str | Path | None) -> RowWriter | None:
        """A writer to ``path`` with this process's provenance; None without a path (nothing is written)."""
        return None if path is None else cls(Path(path), provenance())

    def __call__(self, rows: Iterable[dict[str, Any]]) -> None:
        append_rows(self.path, rows, self.meta)


def _numbered_rows(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read rows from {str(path)!r}: {e.strerror or e}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{str(path)!r} line {number} is not JSON: {e.msg}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{str(path)!r} line {number} is not a row: expected a JSON object, got "
                                 f"{type(row).__name__} {line.strip()[:40]}")
            rows.append((number, row))
    return rows


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file.

    Raises:
        ValueError: if the file cannot be read or a line is not a JSON object (naming the file and the line).
    """
    return [row for _, row in _numbered_rows(path)]


@dataclass(frozen=True)
class RowKind:
    """What makes a row one that a command's tables read: its ``key`` holds one of the values of ``needs``, and
    the row has every field that value needs (so the tables never meet a row without a field they read)."""

    name: str  # the command's, for messages: "ddp rows"
    key: str
    needs: Mapping[str, tuple[str, ...]]

    def mismatch(self, row: Mapping[str, Any]) -> str | None:
        """Why ``row`` is not of this kind (as in "line 3 has no 'op'"), or None if it is."""
        if self.key not in row:
            return f"has no {self.key!r}"
        value = row[self.key]
        if value not in self.needs:
            return f"has {self.key} {value!r}, not one of {', '.join(map(str, self.needs))}"
        missing = [k for k in self.needs[value] if k not in row]
        return f"has {self.key} {value!r} but no {', '.join(map(repr, missing))}" if missing else None


def read_rows_of(paths: Sequence[str | Path], kind: RowKind) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of ``kind`` in the JSON-lines files ``paths``, and one note for each file with rows of another
    kind, which are left out (a file may hold rows of several studies).

    Raises:
        ValueError: if a file cannot be read or a line is not a JSON object (:func:`read_rows`), or if no row of
            any file is of ``kind`` (naming the first line that is not, and why).
    """
    rows, notes, first_other = [], [], None
    for path in paths:
        other = []
        for number, row in _numbered_rows(path):
            why = kind.mismatch(row)
            if why is None:
                rows.append(row)
            else:
                other.append(f"line {number} {why}")
        if other:
            first_other = first_other or (other[0] if len(paths) == 1 else f"{str(path)!r} {other[0]}")
            more = f"; and {len(other) - 1} more" if len(other) > 1 else ""
            rows_word = "rows" if len(other) > 1 else "row"
            notes.append(f"left out {len(other)} {rows_word} of {str(path)!r} that are not {kind.name} rows "
                         f"({other[0]}{more})")
    if not rows:
        files = ", ".join(repr(str(p)) for p in paths)
        raise ValueError(f"no {kind.name} rows in {files}: " + (first_other or "no rows at all"))
    return rows, notes
