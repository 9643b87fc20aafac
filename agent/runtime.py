"""The llama.cpp runtime: what this checkout pins, and what a built worker binary runs.

A tracker admits nodes whose worker runs the pinned commit with the same patch series (the
recipe depends on both); a node puts what its binary reports into its fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
from pathlib import Path

__all__ = ["Device", "RuntimeInfo", "expected_pin", "worker_runtime"]

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Device:
    backend: str
    name: str
    total_bytes: int
    free_bytes: int


@dataclasses.dataclass(frozen=True)
class RuntimeInfo:
    llama_cpp_commit: str
    patch_series_sha256: str
    backends: tuple[str, ...]
    devices: tuple[Device, ...]


def expected_pin(repo_root: Path = REPO_ROOT) -> tuple[str, str]:
    """(llama.cpp commit, patch-series sha256) of this checkout: ``native/llama.cpp.json`` and
    the bytes of ``patches/*.patch`` in series order (as ``packaging/llama_source.py`` hashes them)."""
    manifest = json.loads((repo_root / "native" / "llama.cpp.json").read_text())
    digest = hashlib.sha256()
    for patch in sorted((repo_root / "patches").glob("*.patch")):
        digest.update(patch.read_bytes())
    return manifest["commit"], digest.hexdigest()


def worker_runtime(binary: str | os.PathLike | None = None, *, timeout_s: float = 30.0) -> RuntimeInfo:
    """What ``baton-worker --version`` reports: pin, patch hash, backends and devices."""
    if binary is None:
        from agent.io.worker.process import find_worker_binary

        binary = find_worker_binary()
    out = subprocess.run(
        [os.fspath(binary), "--version"], capture_output=True, text=True, timeout=timeout_s, check=True
    ).stdout
    data = json.loads(out)
    return RuntimeInfo(
        llama_cpp_commit=data["llama_cpp_commit"],
        patch_series_sha256=data["patch_series_sha256"],
        backends=tuple(data["backends"]),
        devices=tuple(Device(**d) for d in data["devices"]),
    )
