"""``writeup/results/`` holds data and logs only: no code (experiment code is a patch in ``writeup/experiments/``),
no archives, and every row's command is what a user types from the repository root: no value in a row names a
folder of the machine that ran it (its command, the files it wrote)."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "writeup" / "results"
# An absolute path: a slash and a name opening a shell word or the value of --flag= ("max / min" is no path).
ABSOLUTE = re.compile(r"(?:^|[\s=(])(/[A-Za-z_.][^\s)]*)")


def code_or_archives(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and any(s in p.name for s in (".py", ".sh", ".tgz")))


def _strings(value: object) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def absolute_paths(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for text in _strings(json.loads(line)) if line.strip() else []:
                if ABSOLUTE.search(text):
                    found.append(f"{path.relative_to(folder)}:{number}: {text}")
    return found


def test_results_hold_no_code_and_no_archives() -> None:
    assert code_or_archives(RESULTS) == []


def test_no_row_names_a_folder_of_the_machine_that_ran_it() -> None:
    assert absolute_paths(RESULTS) == []


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    for name in ("probe.py.txt", "call.sh", "s11a.sh.txt", "ncu.tgz", "notes.md", "rows.jsonl", "smi.csv"):
        (tmp_path / "logs").mkdir(exist_ok=True)
        (tmp_path / "logs" / name).write_text("")
    assert code_or_archives(tmp_path) == ["logs/call.sh", "logs/ncu.tgz", "logs/probe.py.txt", "logs/s11a.sh.txt"]
    rows = [{"command": "cs336 bench --out writeup/results/x.jsonl --plot $OUT/a.png"}, {"value": 1},
            {"command": "/work/main/packages/harness/src/cs336_harness/cli.py bench"},
            {"command": "cs336 ddp --trace-dir=/tmp/tr"}, {"command": "uv run python tools/x.py --out /root/out/x"},
            {"command": "bash tools/gpu.sh python3 scratch/p.py (scratch/ from writeup/experiments/p.patch on abc)"},
            {"memory": {"snapshot": "/tmp/tmp.x/memory.pickle"}, "note": "max / min"},
            {"profile": {"trace": "writeup/results/traces/t.json.gz"}, "ms_calls": [1.0, 2.0]}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert [hit.split(":")[1] for hit in absolute_paths(tmp_path)] == ["3", "4", "5", "7"]
