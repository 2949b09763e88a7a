"""The kernels package on the torch, Triton and transformers releases at the ends of its declared ranges, one fresh
environment each.

For each torch release asked for (default: the oldest and the newest minor release that
``packages/kernels/pyproject.toml`` admits, each at its newest patch), a virtual environment gets that torch from PyPI,
the Triton release that torch pins (the pair a user gets), and this checkout's ``cs336-kernels`` with every extra and
its test tools; the ``hf`` extra's ``transformers`` goes with the torch end it shares (its oldest minor release with the
oldest torch, its newest with the newest; the newest for a torch asked for by name). The package's whole suite then
runs there from the package alone, on CPU in Triton's interpreter, slow tests included (among them the offline sm_90
builds of every kernel, the Gluon attention kernels too). One row per environment goes to
``writeup/results/kernels_compat.jsonl``: the versions, the declared ranges it ran under, pytest's counts and whether
the sm_90 builds passed. ``tests/test_kernels_compat.py`` checks at every CI run that both ends of the declared ranges
have a passing row under them, so a range cannot change without a new run. ::

    uv run python tools/kernels_compat.py                  # both ends of the declared range
    uv run python tools/kernels_compat.py --torch 2.13     # other torch minor releases, each with its Triton

PyPI's torch for Linux is the CUDA build with NVIDIA's libraries (about 5 GB an environment, hard-linked from uv's
cache where it can be); it runs on a CPU. Each suite takes a few minutes on two cores; run it on idle ones.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

from cs336_harness.results import append_rows, provenance
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "packages" / "kernels"
OUT = ROOT / "writeup" / "results" / "kernels_compat.jsonl"
PINNED = ("torch", "triton", "transformers")
# The test that compiles every kernel for sm_90 (the Gluon attention kernels among them) under the installed Triton.
SM90_TEST = "test_kernels_build_for_sm90"
PYTHON = "3.11"


def declared_range(pyproject: Path = KERNELS / "pyproject.toml") -> dict[str, str]:
    """The kernels package's version specifiers of torch, Triton and (its ``hf`` extra's) transformers, as
    ``{"torch": "<2.16,>=2.10", ...}`` (packaging's normal form: its clauses sorted)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    dependencies = [*project["dependencies"], *project.get("optional-dependencies", {}).get("hf", [])]
    found = {req.name: str(req.specifier) for req in map(Requirement, dependencies) if req.name in PINNED}
    if sorted(found) != sorted(PINNED):
        raise ValueError(f"{pyproject} must require each of {PINNED} (transformers in its hf extra); it requires "
                         f"{dependencies}")
    return found


def range_ends(spec: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """The oldest and the newest minor release, as (major, minor), that ``spec`` (``">=A.B,<C.D"``) admits."""
    clauses = list(SpecifierSet(spec))
    bounds = {c.operator: Version(c.version).release for c in clauses if c.operator in ("<", ">=")}
    if len(clauses) != 2 or len(bounds) != 2 or len(bounds["<"]) < 2 or bounds["<"][1] == 0:
        raise ValueError(f"a range must read '>=A.B,<C.D' with D >= 1, got {spec!r}")
    lower, upper = bounds[">="], bounds["<"]
    return (lower[0], lower[1] if len(lower) > 1 else 0), (upper[0], upper[1] - 1)


def minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version such as ``"2.15.0+cu132"``."""
    release = Version(version).release
    return release[0], release[1] if len(release) > 1 else 0


def missing_runs(declared: dict[str, str], rows: list[dict]) -> list[str]:
    """The ends of the declared ranges that no passing row recorded under them covers: the oldest set (the oldest
    minor release of torch, Triton and transformers in one run) and the newest set. A row passes when its suite passed
    and its sm_90 builds ran and passed."""
    passing = [row for row in rows if row.get("requires") == declared and row.get("returncode") == 0
               and row.get("sm90_builds") == "passed"]
    ends = {package: range_ends(spec) for package, spec in declared.items()}
    missing = []
    for index, end in enumerate(("oldest", "newest")):
        pair = {package: ends[package][index] for package in PINNED}
        if not any(all(package in row and minor(row[package]) == pair[package] for package in PINNED)
                   for row in passing):
            missing.append(f"{end} set: " + " + ".join(f"{p} {pair[p][0]}.{pair[p][1]}" for p in PINNED))
    return missing


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("$ " + " ".join(command), flush=True)
    return subprocess.run(command, check=True, **kwargs)


def _counts(summary: str) -> dict[str, int]:
    # pytest's last line: "394 passed, 112 skipped, 2 warnings in 165.86s".
    found = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary)}
    return {"passed": found.get("passed", 0), "failed": found.get("failed", 0),
            "errors": found.get("errors", found.get("error", 0)), "skipped": found.get("skipped", 0)}


def _outcome(junit: Path, test: str) -> str:
    # passed, failed, skipped, or "not run" from pytest's JUnit XML.
    for case in ET.parse(junit).iter("testcase"):
        if case.get("name") == test:
            for tag in ("failure", "error", "skipped"):
                if case.find(tag) is not None:
                    return "failed" if tag in ("failure", "error") else "skipped"
            return "passed"
    return "not run"


def compat_row(torch_minor: str, transformers_minor: str, declared: dict[str, str], folder: Path) -> tuple[dict, dict]:
    """Build the environment of ``torch_minor`` and ``transformers_minor`` in ``folder``, run the suite there; its row
    and versions."""
    venv = folder / "venv"
    python = venv / "bin" / "python"
    _run(["uv", "venv", "--quiet", "--python", PYTHON, str(venv)])
    pyproject = tomllib.loads((KERNELS / "pyproject.toml").read_text())
    extras = ",".join(pyproject["project"]["optional-dependencies"])
    # setuptools: torch.compile under torch 2.10 on Python 3.11 needs it, and torch 2.10 declares it for 3.12 only.
    _run(["uv", "pip", "install", "--quiet", "--python", str(python), f"torch=={torch_minor}.*",
          f"transformers=={transformers_minor}.*", f"{KERNELS}[{extras}]", *pyproject["dependency-groups"]["dev"],
          "setuptools"])
    probe = "import json, platform, torch, triton, transformers; print(json.dumps([torch.__version__, " \
            "triton.__version__, transformers.__version__, platform.python_version()]))"
    found = json.loads(_run([str(python), "-c", probe], capture_output=True, text=True).stdout)
    versions = dict(zip(("torch", "triton", "transformers", "python"), found, strict=True))
    junit = folder / "junit.xml"
    start = time.perf_counter()
    suite = subprocess.run([str(python), "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider",
                            f"--junit-xml={junit}"], cwd=KERNELS, capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = [line for line in suite.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else ""
    row = {"what": "the kernels package's CPU suite in a fresh environment", "requires": declared,
           "torch_asked": f"{torch_minor}.*", "transformers_asked": f"{transformers_minor}.*",
           "pytest_summary": summary, **_counts(summary),
           "returncode": suite.returncode, "sm90_builds": _outcome(junit, SM90_TEST) if junit.exists() else "not run",
           "wall_s": round(wall, 1)}
    if suite.returncode != 0:
        print(suite.stdout[-5000:], suite.stderr[-2000:], sep="\n", file=sys.stderr)
    return row, versions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", nargs="+", default=None, metavar="MAJOR.MINOR",
                        help="torch minor releases to run (default: both ends of the declared range)")
    parser.add_argument("--out", default=str(OUT), help="rows file (default: %(default)s)")
    args = parser.parse_args()
    declared = declared_range()
    torch_ends, transformers_ends = ([f"{a}.{b}" for a, b in range_ends(declared[package])]
                                     for package in ("torch", "transformers"))
    # The ends go together (oldest with oldest); a torch asked for by name gets the newest transformers.
    runs = list(zip(torch_ends, transformers_ends, strict=True)) if args.torch is None else [
        (torch_minor, transformers_ends[1]) for torch_minor in args.torch]
    # Taken once, before the first row makes the rows file (tracked) differ from the commit.
    meta = provenance()
    status = 0
    for torch_minor, transformers_minor in runs:
        with tempfile.TemporaryDirectory(prefix="kernels-compat-") as folder:
            row, versions = compat_row(torch_minor, transformers_minor, declared, Path(folder))
        append_rows(args.out, [row], meta | versions)
        print(f"torch {versions['torch']} + triton {versions['triton']} + transformers {versions['transformers']}: "
              f"{row['pytest_summary']} "
              f"(sm_90 builds {row['sm90_builds']})", flush=True)
        status |= row["returncode"] != 0 or row["sm90_builds"] != "passed"
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
