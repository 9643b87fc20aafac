"""The front door: the README and docs say what they link to, speak of the project rather than
of its past milestones, and the README's shell commands work as written.

- Every relative link (and its #anchor) in README.md, docs/ and bench/README.md resolves.
- No file of the README, docs/, bench/, agent/, protocol/, native/ or tests/ names an internal
  milestone (a numbered stop or issue, or the current stop).
- Every shell block in README.md is in ``README_BLOCKS``: run here (the cheap ones that need no
  build, model, second machine or long-running server), or named with why not.
- bench/results/ holds no file named after a milestone, and docs/PERFORMANCE.md names every
  product benchmark and its results.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

LINKED_DOCS = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Built from parts so that this file does not match itself.
MILESTONE = re.compile(r"\b" + "stop" + r" [0-9]+\b|\bthis " + "stop" + r"\b|\b" + "issue" + r" [0-9]+", re.IGNORECASE)
MILESTONE_NAME = re.compile(r"(stop|issue)[-_ ]?[0-9]+", re.IGNORECASE)
SCANNED = ["README.md", "docs", "bench", "agent", "protocol", "native", "tests", "Makefile", "pyproject.toml"]

#: README.md's shell blocks, by their first command line: None runs it here (in a temporary
#: folder whose .venv/bin/baton is this checkout's ``baton``); a string says why it is not run.
README_BLOCKS: dict[str, str | None] = {
    "make demo": "installs Debian packages and builds llama.cpp (minutes); tests/test_demo.py runs `baton demo`",
    ".venv/bin/baton demo --serve": "serves until Ctrl-C; tests/test_demo.py and tests/test_relay_e2e.py cover it",
    "curl -N http://127.0.0.1:PORT/v1/chat/completions": "needs the relay `baton demo --serve` started",
    ".venv/bin/baton tracker serve": "a long-running tracker, nodes on other machines and a relay; "
    "tests/test_swarm_e2e.py and tests/test_relay_e2e.py start them on loopback",
    ".venv/bin/baton relay keys add": None,
    "make venv && .venv/bin/baton node install": "builds the worker and installs a per-user service",
    ".venv/bin/baton node status": "inspects (and uninstall removes) the user's installed service",
    ".venv/bin/baton --help": None,
}


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", path.read_text(), re.MULTILINE)}


def _links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # links inside code are not links
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for link in _links(doc.read_text()):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto: not ours to check offline
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{link}: no {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link}: no heading #{anchor} in {path.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}:\n" + "\n".join(broken)


def _scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = REPO / name
        files += [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    return [p for p in files if "__pycache__" not in p.parts and "_proto" not in p.parts]


def test_no_file_names_an_internal_milestone() -> None:
    found = []
    for path in _scanned_files():
        text = path.read_bytes().decode("utf-8", errors="ignore")
        for number, line in enumerate(text.splitlines(), 1):
            if match := MILESTONE.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {match.group(0)!r}")
    assert not found, "\n".join(found)


def test_readme_is_a_front_door() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for heading in ("## Quick start", "## Use it", "## Run a swarm", "## Volunteer a machine", "## How it works",
                    "## Where it stands", "## Documentation", "## Development", "## License"):  # fmt: skip
        assert heading in text
    assert "make demo" in text.split("## Quick start")[1].split("##")[0]


def _readme_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(r"^```sh\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def _first_command(block: str) -> str:
    return next(line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def test_every_readme_shell_block_is_run_or_says_why_not() -> None:
    firsts = [_first_command(block) for block in _readme_blocks()]
    unlisted = [f for f in firsts if not any(f.startswith(key) for key in README_BLOCKS)]
    assert not unlisted, f"README shell blocks missing from README_BLOCKS: {unlisted}"
    stale = [key for key in README_BLOCKS if not any(f.startswith(key) for f in firsts)]
    assert not stale, f"README_BLOCKS entries no README block starts with: {stale}"


@pytest.fixture
def venv_shim(tmp_path: Path) -> Path:
    """A folder whose ``.venv/bin/baton`` runs this checkout's ``baton`` with this interpreter."""
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    shim = bin_dir / "baton"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH="{REPO}" exec "{sys.executable}" -m agent.cli "$@"\n')
    shim.chmod(0o755)
    return tmp_path


@pytest.mark.parametrize("key", [k for k, why in README_BLOCKS.items() if why is None])
def test_readme_block_runs_as_written(key: str, venv_shim: Path) -> None:
    (block,) = [b for b in _readme_blocks() if _first_command(b).startswith(key)]
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block], cwd=venv_shim, capture_output=True, text=True, timeout=90,
        env={**os.environ, "BATON_CACHE": str(venv_shim / "cache")},
    )  # fmt: skip
    assert done.returncode == 0, f"{block}\n--- stderr:\n{done.stderr}"
    if key.startswith(".venv/bin/baton relay keys add"):
        assert done.stdout.startswith("sk-baton-")  # the key, printed once
        assert "alice" in done.stdout.split("\n", 1)[1]  # listed by keys list


def test_bench_results_are_named_after_what_they_measure_and_documented() -> None:
    results = REPO / "bench" / "results"
    named = [p.relative_to(results) for p in results.rglob("*") if MILESTONE_NAME.search(p.name)]
    assert not named, f"named after a milestone: {named}"
    assert all(p.is_file() for p in results.iterdir()), "bench/results/ holds the latest run of each, no folders"
    performance = (REPO / "docs" / "PERFORMANCE.md").read_text()
    for stem in sorted({p.name.split(".")[0] for p in results.iterdir()}):
        assert f"bench/results/{stem}." in performance, f"docs/PERFORMANCE.md does not reference {stem}'s results"
    helpers = {"_bootstrap.py", "common.py", "compare_report.py", "results_io.py"}
    for script in sorted(p.name for p in (REPO / "bench").glob("*.py") if p.name not in helpers):
        assert f"bench/{script}" in performance, f"docs/PERFORMANCE.md does not describe bench/{script}"
