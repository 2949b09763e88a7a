"""Each package imports, and declares dependencies on, only the packages below it."""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package dir -> the cs336 packages it may use (besides itself)
ALLOWED = {
    "basics": set(),
    "kernels": set(),
    "comms": set(),
    "sharding": {"kernels", "comms"},
    "harness": {"basics", "kernels", "comms", "sharding"},
}


def _imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n.split(".")[0].removeprefix("cs336_") for n in names if n.startswith("cs336_")}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_sources_import_only_lower_layers(package):
    src = ROOT / "packages" / package / "src"
    offenders = {}
    for path in src.rglob("*.py"):
        bad = _imported_packages(path) - ALLOWED[package] - {package}
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert not offenders, f"imports of higher or sibling layers: {offenders}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_dependencies_name_only_lower_layers(package):
    meta = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    deps = {
        d.split(";")[0].split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip()
        for d in meta["project"]["dependencies"]
    }
    ours = {d.removeprefix("cs336-") for d in deps if d.startswith("cs336-")}
    assert ours == ALLOWED[package], f"{package} depends on {sorted(ours)}, expected {sorted(ALLOWED[package])}"
    if package == "kernels":
        assert deps == {"torch", "triton"}, f"kernels must depend on torch and triton only, got {sorted(deps)}"


def test_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("import os\nfrom cs336_harness.cli import main\nimport cs336_basics.model as m\n")
    assert _imported_packages(bad) == {"harness", "basics"}
