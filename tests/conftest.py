"""Shared pytest fixtures and hooks for the whole suite.

Owns: the ``gpu`` and ``lab`` skip rules, the rule that every test is in exactly one tier
(unit, worker, swarm, lab), the session fixtures that hand out pinned model files, and access to
the packaging scripts (which are scripts, not a package: ``packaging`` would clash with the PyPI
project of that name). Markers and warning filters are declared in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from agent.models import model_path
from agent.testing.tiny_models import tiny_model_path

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_packaging_script(name: str) -> ModuleType:
    """Import ``packaging/<name>.py`` as module ``baton_packaging_<name>`` (once)."""
    module_name = f"baton_packaging_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, REPO_ROOT / "packaging" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before exec: dataclasses resolve their module through sys.modules.
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


#: The suite's tiers (pyproject.toml's markers say what each needs).
TIERS = ("unit", "worker", "swarm", "lab")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = [
        f"{item.nodeid} ({', '.join(t for t in TIERS if t in item.keywords) or 'none'})"
        for item in items
        if sum(t in item.keywords for t in TIERS) != 1
    ]
    if untiered:
        raise pytest.UsageError(
            "every test needs exactly one tier mark (" + ", ".join(TIERS) + "), usually its module's pytestmark; "
            "these have none or several: " + "; ".join(untiered[:10])
        )
    skip_gpu = pytest.mark.skip(reason="needs a GPU; set BATON_GPU=1 to run")
    # CI runs as root: there the lab's tests always run
    skip_lab = pytest.mark.skip(reason="the lab needs root (network namespaces, TUN devices)")
    for item in items:
        if "gpu" in item.keywords and os.environ.get("BATON_GPU") != "1":
            item.add_marker(skip_gpu)
        if "lab" in item.keywords and os.geteuid() != 0:
            item.add_marker(skip_lab)


@pytest.fixture(scope="session")
def llama_source() -> ModuleType:
    """The ``packaging/llama_source.py`` module."""
    return load_packaging_script("llama_source")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (llama arch, 30 blocks, tied embeddings)."""
    return model_path("smollm2")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma-3-270M Q4_K_M (gemma3 arch, 18 blocks, sliding-window pattern 6)."""
    return model_path("gemma3")


@pytest.fixture(scope="session")
def qwen2_tiny_path() -> Path:
    """Synthetic qwen2 (6 blocks, n_embd 64, q/k/v biases, tied embeddings)."""
    return tiny_model_path("qwen2-tiny")


@pytest.fixture(scope="session")
def qwen3_tiny_path() -> Path:
    """Synthetic qwen3 (6 blocks, n_embd 64, per-head q/k norms, separate output head)."""
    return tiny_model_path("qwen3-tiny")


@pytest.fixture(scope="session")
def deepseek4_tiny_path() -> Path:
    """Synthetic DeepSeek V4 (6 blocks, n_embd 64, 4 hyper-connection streams, compression
    ratios 0, 4, 128, 4, 128, 0, hash-routed block 0)."""
    return tiny_model_path("deepseek4-tiny")


def _tcp_timer(server_port: int, client_port: int) -> int | None:
    """The kernel's timer on the accepted end of a loopback TCP connection (``/proc/net/tcp``'s
    ``tr``): 2 while a keepalive timer is set on an idle established socket, 0 without one, 1
    while data waits for its ACK; None when there is no such socket (yet)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, timer = fields[1], fields[2], fields[5]
        if int(local.split(":")[1], 16) == server_port and int(remote.split(":")[1], 16) == client_port:
            return int(timer.split(":")[0], 16)
    return None


async def _idle_tcp_timer(server_port: int, client_port: int) -> int:
    """``_tcp_timer`` once the socket exists and nothing it sent waits for an ACK (a condition
    polled, at most 10 s: the ACK of the last reply may be delayed)."""
    import trio

    with trio.fail_after(10):
        while (timer := _tcp_timer(server_port, client_port)) in (None, 1):
            await trio.sleep(0.01)
    return timer


@pytest.fixture
def idle_tcp_timer():
    """``await idle_tcp_timer(server_port, client_port)``: see ``_idle_tcp_timer`` (Linux)."""
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux's /proc/net/tcp")
    return _idle_tcp_timer
