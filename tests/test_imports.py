"""The import graph of ``agent``: no module circles, and no product module imports ``agent.testing``.

Imports are read from the sources with ``ast``, not by importing them, so every import counts:
module-level ones, those under ``if TYPE_CHECKING:`` (a circle hidden there is still a circle
in the design, and one annotation evaluated at run time turns it into a real one) and those
inside functions (deferred imports that hide a circle from the interpreter, not from a reader).

How packages count. Importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` first,
and a package's ``__init__`` often re-exports its submodules (``agent.io.client`` imports
``.swarm``); counting that implicit step would make every such package a circle with its own
members. So ``import a.b.c`` and ``from a.b import c`` (``c`` a submodule) are edges to module
``a.b.c`` only; ``from a.b import name`` (``name`` not a submodule) is an edge to the package
``a.b`` itself, because that runs its ``__init__``'s code for the name: a submodule that takes a
name from its own package's ``__init__``, which imports that submodule back, is a real circle
and is reported.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

import agent

pytestmark = pytest.mark.unit

AGENT_DIR = Path(agent.__file__).resolve().parent


def _modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> source, for every module of the package at ``package_dir``."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported(module: str, path: Path, modules: set[str]) -> Iterator[tuple[str, int]]:
    """(one of ``modules`` that ``module`` imports, line) for every import in its source."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # ``from . import x`` in a/b/c.py resolves against a.b; in a/b/__init__.py too
                package = module.split(".") if is_package else module.split(".")[:-1]
                base_parts = package[: len(package) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    yield submodule, node.lineno
                elif base in modules:
                    yield base, node.lineno


def _import_graph(package_dir: Path = AGENT_DIR) -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: first line}, self-imports left out."""
    paths = _modules(package_dir)
    names = set(paths)
    graph: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        edges: dict[str, int] = {}
        for target, line in _imported(module, path, names):
            if target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph is deep enough to matter for recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def _a_circle(component: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """One circle through the component's first module, as 'module:line -> ...' steps."""
    members = set(component)
    start = component[0]
    # breadth-first from start's successors back to start, inside the component
    parent: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        next_frontier = []
        for node in frontier:
            for succ in sorted(graph[node]):
                if succ not in members:
                    continue
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    path.reverse()
                    path.append(start)
                    return [f"{a} (line {graph[a][b]}) -> {b}" for a, b in itertools.pairwise(path)]
                if succ not in seen:
                    seen.add(succ)
                    parent[succ] = node
                    next_frontier.append(succ)
        frontier = next_frontier
    raise AssertionError(f"no circle through {start} in {component}")


def test_the_graph_reads_every_kind_of_import(tmp_path: Path) -> None:
    sources = {
        "pkg/__init__.py": "from .a import A\n",  # a package re-exporting its member
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.sub.deep\nA = 1\n",
        "pkg/b.py": "import os\n\ndef f():\n    from . import c\n    from .sub import deep\n",
        "pkg/c.py": "from pkg import A\nfrom pkg.sub.deep import X\n",  # a name of pkg, a name of deep
        "pkg/sub/__init__.py": "",
        "pkg/sub/deep.py": "from .. import sub\nfrom ..a import A\nX = 1\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = _import_graph(tmp_path / "pkg")
    assert graph == {
        "pkg": {"pkg.a": 1},
        "pkg.a": {"pkg.sub.deep": 3},  # under TYPE_CHECKING
        "pkg.b": {"pkg.c": 4, "pkg.sub.deep": 5},  # inside a function; os is not of the package
        "pkg.c": {"pkg": 1, "pkg.sub.deep": 2},  # a name of pkg's __init__ is an edge to it
        "pkg.sub": {},
        "pkg.sub.deep": {"pkg.sub": 1, "pkg.a": 2},  # relative imports two levels up
    }
    # being inside pkg is no edge to pkg: the one circle is a <-> deep, hidden under TYPE_CHECKING
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert circles == [["pkg.a", "pkg.sub.deep"]]
    assert _a_circle(circles[0], graph) == ["pkg.a (line 3) -> pkg.sub.deep", "pkg.sub.deep (line 2) -> pkg.a"]


def test_agent_has_no_import_circle() -> None:
    graph = _import_graph()
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    report = "\n\n".join(
        f"{len(c)} modules import each other: {', '.join(c)}\none circle:\n  " + "\n  ".join(_a_circle(c, graph))
        for c in circles
    )
    assert not circles, "import circles in agent/ (TYPE_CHECKING and function-level imports count):\n" + report


def test_no_product_module_imports_agent_testing() -> None:
    # agent.testing is what the tests install (synthetic models, fault injection); the product
    # must run without it, so nothing outside it may import it, not even inside a function.
    graph = _import_graph()
    offenders = [
        f"{module} (line {line}) imports {target}"
        for module, edges in sorted(graph.items())
        if not (module == "agent.testing" or module.startswith("agent.testing."))
        for target, line in sorted(edges.items())
        if target == "agent.testing" or target.startswith("agent.testing.")
    ]
    assert not offenders, "product modules import agent.testing:\n" + "\n".join(offenders)


#: What each role's package may import of the others (docs/ARCHITECTURE.md, "Who may import
#: what"). A package always may import itself and ``agent._proto``. Core roles sit on
#: ``core.wire`` (the records every role exchanges), which sits on ``core.net``; a shell
#: (``io.<role>``) uses its own core, the wire and the shared shells (``io``, ``io.net``,
#: ``io.worker``). The exceptions say why.
ALLOWED_IMPORTS: dict[str, set[str]] = {
    "core.net": set(),
    "core.wire": {"core.net"},
    "core.lab": set(),
    "core.tracker": {"core.net", "core.wire"},
    "core.node": {"core.net", "core.wire"},
    # spot checks judge a hop's output with the canaries' comparison (core.tracker.canary)
    "core.owner": {"core.net", "core.wire", "core.tracker"},
    # the relay is a session owner
    "core.relay": {"core.net", "core.wire", "core.owner"},
    # model_http answers Range requests with the node's range parsing
    "io": {"core.net", "core.wire", "core.node"},
    "io.net": {"core.net", "core.wire", "io"},
    # a worker's thread wait policy is the node's rule; vocab workers render owners' chat templates
    "io.worker": {"core.net", "core.wire", "core.node", "core.owner", "io", "io.net"},
    "io.lab": {"core.lab"},
    "io.tracker": {"core.tracker", "core.net", "core.wire", "core.node", "io", "io.net", "io.worker"},
    # a first hop checks an owner's data-plane bind with the owner's own route rules
    "io.node": {"core.node", "core.net", "core.wire", "core.owner", "io", "io.net", "io.worker"},
    "io.client": {"core.owner", "core.relay", "core.net", "core.wire", "io", "io.net", "io.worker"},
    # the relay owns sessions through the client's SwarmClient
    "io.relay": {"core.relay", "core.owner", "core.net", "core.wire", "io", "io.net", "io.worker", "io.client"},
}


#: what every shell may use: shared command-line flags, the pinned models, the checkout's runtime
SHELL_COMMONS = {"agent.cli_args", "agent.models", "agent.runtime"}


def _role(module: str) -> str | None:
    """``agent.core.wire.boundary`` -> ``core.wire``; ``agent.io.keys`` -> ``io``; None outside
    the role packages (the command line, demos, harness and testing may use every role)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in ("core", "io"):
        return None
    if len(parts) > 2 and f"{parts[1]}.{parts[2]}" in ALLOWED_IMPORTS:
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 2 or parts[1] == "io" else None


def test_each_role_imports_only_what_its_row_allows() -> None:
    graph = _import_graph()
    offenders = []
    for module, edges in sorted(graph.items()):
        role = _role(module)
        if role is None:
            continue
        for target, line in sorted(edges.items()):
            target_role = _role(target)
            if target_role is None and target.startswith(("agent._proto", "agent.core", "agent.io")):
                continue  # the generated protos; a package's own __init__
            if role.startswith("io") and target in SHELL_COMMONS:
                continue
            if target_role == role or target_role in ALLOWED_IMPORTS[role]:
                continue
            offenders.append(f"{module} (line {line}) imports {target} ({target_role or 'outside the roles'})")
    assert not offenders, "imports across roles that ALLOWED_IMPORTS does not allow:\n" + "\n".join(offenders)


def test_every_module_of_core_is_in_a_role() -> None:
    # a module dropped straight into agent/core would escape the rules above
    strays = [m for m in _import_graph() if m.count(".") == 2 and m.startswith("agent.core.")]
    assert [m for m in strays if m.removeprefix("agent.") not in ALLOWED_IMPORTS] == []
