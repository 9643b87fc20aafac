"""The architecture's map is true: every file docs/ARCHITECTURE.md and docs/LAYOUT.md name
exists, and the architecture's "Who may import what" table is the rule tests/test_imports.py
enforces. A move that forgets the docs fails here, not in a newcomer's hands."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from test_imports import ALLOWED_IMPORTS

from agent.runtime import REPO_ROOT

pytestmark = pytest.mark.unit

DOCS = REPO_ROOT / "docs"
TOP_FOLDERS = ("agent/", "native/", "protocol/", "tests/", "bench/", "docs/", "packaging/", "patches/")


def _named_paths(doc: Path) -> list[str]:
    """Repository paths in backticks (``agent/core/wire/boundary.py``), placeholders left out."""
    return sorted(
        {
            token
            for token in re.findall(r"`([^`\s]+)`", doc.read_text())
            if token.startswith(TOP_FOLDERS) and not re.search(r"[<>*{}|]|NNNN", token)
        }
    )


def _named_modules(doc: Path) -> list[str]:
    """Dotted names in backticks (``agent.core.wire.boundary``), file names (``agent.py``) left out."""
    names = re.findall(r"`(agent(?:\.[a-z_0-9]+)+)`", doc.read_text())
    return sorted({name for name in names if not name.endswith((".py", ".md"))})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("doc", ["ARCHITECTURE.md", "LAYOUT.md"])
def test_every_path_the_doc_names_exists(doc: str) -> None:
    paths = _named_paths(DOCS / doc)
    assert len(paths) > 20  # the pattern still finds the table's paths
    missing = [p for p in paths if not (REPO_ROOT / p).exists() and p != "agent/_proto"]
    assert missing == [], f"docs/{doc} names files that do not exist"


@pytest.mark.timeout(30)
def test_every_module_the_architecture_names_exists() -> None:
    modules = _named_modules(DOCS / "ARCHITECTURE.md")
    missing = [m for m in modules if not m.startswith("agent._proto") and not _resolves(m)]
    assert missing == []


def _resolves(dotted: str) -> bool:
    """A module, or a name one defines (``agent.core.node.policy.data_plane_decode_groups``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


@pytest.mark.timeout(30)
def test_the_import_table_is_the_rule_the_import_test_enforces() -> None:
    text = (DOCS / "ARCHITECTURE.md").read_text()
    section = text[text.index("### Who may import what") :]
    rows = re.findall(r"^\| `([a-z.]+)` \| (.*) \|$", section, flags=re.M)
    table = {package: set(re.findall(r"`([a-z.]+)`", allowed)) for package, allowed in rows}
    assert table == ALLOWED_IMPORTS
