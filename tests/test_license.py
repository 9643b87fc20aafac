"""The project's license reaches the installed package: LICENSE is MIT, the built metadata says
so (PEP 639's License-Expression, the file shipped in the wheel), and ``pip show`` names it.

The package is built from a copy of the files it is made of (pyproject.toml, README.md, LICENSE,
agent/) in a temporary folder, so the build writes nothing into the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from email.parser import Parser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.worker, pytest.mark.timeout(180), pytest.mark.slow]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that holds the package as ``pip install --target`` left it."""
    base = tmp_path_factory.mktemp("license")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "agent", src / "agent", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    target = base / "target"
    # No build isolation: the environment's setuptools builds it (offline, seconds); no deps.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
         "--no-build-isolation", "--target", str(target), str(src)],
        check=True, cwd=base, timeout=150,
    )  # fmt: skip
    return target


def test_license_file_is_mit() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License\n")
    assert "Permission is hereby granted, free of charge" in text


def test_built_metadata_names_the_license_and_ships_the_file(installed: Path) -> None:
    (dist_info,) = installed.glob("baton-*.dist-info")
    metadata = Parser().parsestr((dist_info / "METADATA").read_text())
    assert metadata["License-Expression"] == "MIT"
    assert metadata["License-File"] == "LICENSE"
    assert (dist_info / "licenses" / "LICENSE").read_text() == (REPO / "LICENSE").read_text()


def test_pip_show_names_the_license(installed: Path) -> None:
    from importlib.metadata import version

    pip_version = tuple(int(part) for part in version("pip").split(".")[:2])
    if pip_version < (25, 0):
        # `make venv` installs pip 26.3 (Makefile, PIP_PIN); an older pip prints only the
        # legacy License field, which PEP 639 metadata leaves empty.
        pytest.skip(f"pip {version('pip')} predates PEP 639's License-Expression in pip show")
    shown = subprocess.run(
        [sys.executable, "-m", "pip", "show", "--disable-pip-version-check", "baton"],
        check=True, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(installed)},
    ).stdout  # fmt: skip
    assert f"Location: {installed}" in shown
    assert "License-Expression: MIT" in shown.splitlines()
