"""Each package imports, and declares dependencies on, only the packages below it, its modules import each other in one
direction (no circle, counting every import: inside functions and for type checking too), and it imports nothing it
does not declare: its sources only its ``dependencies``, its ``tests/`` those, its extras and its ``dev`` group (what
the tests need besides the package; uv installs that group with the package), so that each package's suite runs in an
environment holding only the package and what it declares (``.ci/run`` runs it so). An import inside a ``try`` that
catches its ``ImportError`` is optional (a tool compared against where it is installed) and needs no declaration.
"""

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package dir -> its layer: a package may use only packages of a lower layer
LAYERS = {"basics": 1, "kernels": 1, "comms": 2, "sharding": 3, "harness": 4}
# package dir -> the cs336 packages its sources may use (besides itself)
ALLOWED = {
    "basics": set(),
    "kernels": set(),
    "comms": set(),
    "sharding": {"comms"},
    "harness": {"basics", "kernels", "comms", "sharding"},
}
_OPTIONAL = {"ImportError", "ModuleNotFoundError", "Exception"}


def _distribution(requirement: str) -> str:
    """The normalised distribution name of a requirement string (PEP 503)."""
    name = re.match(r"[A-Za-z0-9_.-]+", requirement.strip()).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports(path: Path) -> set[tuple[str, bool]]:
    """``(top-level module, optional)`` of every absolute import in ``path``; optional when inside a ``try`` whose
    handlers catch the import's failure."""
    tree = ast.parse(path.read_text(), filename=str(path))
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            caught = {getattr(h.type, "id", None) for h in node.handlers} | {
                getattr(e, "id", None) for h in node.handlers if isinstance(h.type, ast.Tuple) for e in h.type.elts}
            if caught & _OPTIONAL:
                guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(a.name.split(".")[0], id(node) in guarded) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add((node.module.split(".")[0], id(node) in guarded))
    return found


def _imported_packages(path: Path) -> set[str]:
    """The cs336 packages (by dir name) that ``path`` imports."""
    return {m.removeprefix("cs336_") for m, _ in _imports(path) if m.startswith("cs336_")}


_TOP_LEVEL = importlib.metadata.packages_distributions()


def _undeclared(paths: list[Path], declared: set[str], local: set[str]) -> dict[Path, list[str]]:
    """file -> the third-party imports of ``paths`` (not standard library, not cs336, not a module in ``local``,
    not optional) whose distribution is not in ``declared``."""
    offenders = {}
    for path in paths:
        bad = []
        for module, optional in _imports(path):
            if optional or module in sys.stdlib_module_names or module in local or module.startswith("cs336_"):
                continue
            dists = {_distribution(d) for d in _TOP_LEVEL.get(module, [module])}
            if not dists & declared:
                bad.append(module)
        if bad:
            offenders[path] = sorted(bad)
    return offenders


def _module_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same source tree that it imports (any import statement, anywhere in the file;
    ``from a.b import c`` is module ``a.b.c`` where that is a module, else ``a.b``)."""
    modules = {".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): p
               for p in src.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                edges |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import circle through each module that is on one (a path back to itself), found depth first."""
    circles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circles.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return circles


def _shown(offenders: dict[Path, list[str]]) -> dict[str, list[str]]:
    return {str(path.relative_to(ROOT)): modules for path, modules in offenders.items()}


def _meta(package: str) -> dict:
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())


def _requirements(meta: dict) -> tuple[set[str], set[str], set[str]]:
    """Distributions of the ``dependencies``, the extras and the ``dev`` group."""
    project = meta["project"]
    deps = {_distribution(d) for d in project["dependencies"]}
    extras = {_distribution(d) for reqs in project.get("optional-dependencies", {}).values() for d in reqs}
    dev = {_distribution(d) for d in meta.get("dependency-groups", {}).get("dev", [])}
    return deps, extras, dev


def _ours(dists: set[str]) -> set[str]:
    return {d.removeprefix("cs336-") for d in dists if d.startswith("cs336-")}


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
def test_modules_import_each_other_without_a_circle(package):
    circles = _circles(_module_graph(ROOT / "packages" / package / "src"))
    assert not circles, f"import circles among {package}'s modules: {[' -> '.join(c) for c in circles]}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_dependencies_name_only_lower_layers(package):
    deps, extras, dev = _requirements(_meta(package))
    assert _ours(deps) == ALLOWED[package], (f"{package} depends on {sorted(_ours(deps))}, expected "
                                             f"{sorted(ALLOWED[package])}")
    if package == "kernels":
        assert deps == {"torch", "triton"}, f"kernels must depend on torch and triton only, got {sorted(deps)}"
    higher = {d for d in _ours(extras | dev) if LAYERS[d] >= LAYERS[package]}
    assert not higher, f"{package}'s extras or dev group name packages not below it: {sorted(higher)}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_sources_import_only_what_they_declare(package):
    deps, _, _ = _requirements(_meta(package))
    paths = sorted((ROOT / "packages" / package / "src").rglob("*.py"))
    offenders = _undeclared(paths, deps, local=set())
    assert not offenders, f"{package}'s sources import what its dependencies do not name: {_shown(offenders)}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_tests_import_only_what_the_package_declares(package):
    deps, extras, dev = _requirements(_meta(package))
    folder = ROOT / "packages" / package / "tests"
    paths = sorted(folder.rglob("*.py"))
    local = {p.stem for p in paths}  # the folder's own helper modules (conftest.py puts it on sys.path)
    declared = deps | extras | dev
    ours = {p for path in paths for p in _imported_packages(path)} - {package}
    assert ours <= _ours(declared), f"{package}'s tests use {sorted(ours - _ours(declared))}, which it does not declare"
    offenders = _undeclared(paths, declared, local)
    assert not offenders, f"{package}'s tests import what it does not declare: {_shown(offenders)}"


def test_cross_package_tests_import_only_what_the_workspace_declares():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = {_distribution(d) for d in meta["project"]["dependencies"]}
    declared |= {_distribution(d) for d in meta["dependency-groups"]["dev"]}
    for package in _ours(declared):  # the workspace holds its packages' dependencies too
        declared |= _requirements(_meta(package))[0]
    paths = sorted((ROOT / "tests").glob("*.py"))
    offenders = _undeclared(paths, declared, local={p.stem for p in paths})
    assert not offenders, f"tests/ imports what the workspace does not declare: {_shown(offenders)}"


def test_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("import os\nfrom cs336_harness.cli import main\nimport cs336_basics.model as m\nimport numpy\n"
                   "try:\n    import liger_kernel\nexcept ImportError:\n    liger_kernel = None\nfrom . import x\n")
    assert _imported_packages(bad) == {"harness", "basics"}
    assert _imports(bad) == {("os", False), ("cs336_harness", False), ("cs336_basics", False), ("numpy", False),
                             ("liger_kernel", True)}
    assert _undeclared([bad], {"torch"}, local=set()) == {bad: ["numpy"]}  # the optional import is not counted
    assert _undeclared([bad], {"numpy"}, local=set()) == {}
    assert _undeclared([bad], {"torch"}, local={"numpy"}) == {}  # a helper module of the tests folder


def test_circle_checker_catches_a_circle(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "plan.py").write_text("from pkg.config import Config\n")
    (package / "config.py").write_text("import torch\n")
    (package / "sub" / "__init__.py").write_text("from pkg.sub import train\n")
    (package / "sub" / "train.py").write_text("from pkg import plan\n\n\ndef build():\n    from pkg import config\n")
    graph = _module_graph(tmp_path)
    assert graph == {"pkg": set(), "pkg.plan": {"pkg.config"}, "pkg.config": set(), "pkg.sub": {"pkg.sub.train"},
                     "pkg.sub.train": {"pkg.plan", "pkg.config"}}
    assert _circles(graph) == []
    # An import inside a function closes a circle as surely as one at the top (the harness's plan and training had
    # one so).
    (package / "config.py").write_text("if False:\n    from pkg.sub.train import build\n")
    assert _circles(_module_graph(tmp_path)) == [["pkg.config", "pkg.sub.train", "pkg.config"],
                                                 ["pkg.config", "pkg.sub.train", "pkg.plan", "pkg.config"]]
