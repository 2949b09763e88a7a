"""The licence: MIT, in LICENSE at the root and in every package (a package's build takes files from its own folder
only), declared in every pyproject (PEP 639: ``license`` and ``license-files``), and carried by the built kernels
wheel and sdist."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))


def test_the_licence_is_mit_for_the_contributors() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n\nCopyright (c) 2026 cs336-systems contributors\n")


@pytest.mark.parametrize("folder", [ROOT, *PACKAGES], ids=lambda p: str(p.relative_to(ROOT)) or "root")
def test_every_pyproject_declares_it_and_ships_the_root_file(folder: Path) -> None:
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    assert (project["license"], project["license-files"]) == ("MIT", ["LICENSE"])
    assert (folder / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("uv") is None, reason="builds with uv")
def test_the_built_kernels_wheel_and_sdist_carry_it(tmp_path: Path) -> None:
    done = subprocess.run(["uv", "build", "--package", "cs336-kernels", "--out-dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    licence = (ROOT / "LICENSE").read_text()
    (wheel,) = tmp_path.glob("cs336_kernels-*.whl")
    with zipfile.ZipFile(wheel) as z:
        info = next(n.split("/")[0] for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        assert z.read(f"{info}/licenses/LICENSE").decode() == licence
        metadata = z.read(f"{info}/METADATA").decode().splitlines()
    assert "License-Expression: MIT" in metadata and "License-File: LICENSE" in metadata
    (sdist,) = tmp_path.glob("cs336_kernels-*.tar.gz")
    with tarfile.open(sdist) as t:
        top = t.getnames()[0].split("/")[0]
        assert t.extractfile(f"{top}/LICENSE").read().decode() == licence
