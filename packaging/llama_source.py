#!/usr/bin/env python3
"""The pinned llama.cpp source tree: fetch, verify, extract, patch.

Owns: the sdist in ``$BATON_CACHE/sdist/`` (sha256-verified against ``native/llama.cpp.json``),
the pristine-then-patched tree ``build/llama.cpp`` and its stamp ``build/llama.cpp.stamp``
(see docs/LAYOUT.md). Standard library only: it runs before any virtual environment exists.
Must not import anything from ``agent``.

Commands::

    python packaging/llama_source.py prepare        # download if absent, verify, extract, patch
    python packaging/llama_source.py verify         # verify the cached sdist (no download)
    python packaging/llama_source.py check-patches  # apply / reverse the series on a scratch copy
    python packaging/llama_source.py series-hash    # print the patch-series sha256
    python packaging/llama_source.py commit         # print the pinned commit

Exit status: 0 on success, 1 on a refused or failed step (one clear line on stderr).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFEST_PATH = REPO_ROOT / "native" / "llama.cpp.json"
PATCHES_DIR = REPO_ROOT / "patches"
BUILD_DIR = REPO_ROOT / "build"

DOWNLOAD_TIMEOUT_S = 120.0
_CHUNK_BYTES = 1 << 20


class SourceError(Exception):
    """A step on the pinned source failed; the message is meant for the user as is."""


class HashMismatchError(SourceError):
    """A file's sha256 is not the pinned one."""

    def __init__(self, path: Path, expected: str, actual: str, note: str = "") -> None:
        self.path = path
        self.expected = expected
        self.actual = actual
        message = f"sha256 mismatch for {path}: expected {expected}, actual {actual}; refusing to use it"
        if note:
            message += f" ({note})"
        super().__init__(message)


class PatchError(SourceError):
    """A patch of the series does not apply (or reverse) cleanly."""

    def __init__(self, patch: Path, step: str, detail: str) -> None:
        self.patch = patch
        self.step = step
        super().__init__(f"patch {patch.name} failed to {step}: {detail.strip()}")


@dataclass(frozen=True)
class Manifest:
    commit: str
    name: str
    version: str
    filename: str
    sha256: str
    url: str
    tree: str

    @classmethod
    def load(cls, path: Path = MANIFEST_PATH) -> Manifest:
        data = json.loads(path.read_text())
        sdist = data["sdist"]
        return cls(
            commit=data["commit"],
            name=sdist["name"],
            version=sdist["version"],
            filename=sdist["filename"],
            sha256=sdist["sha256"],
            url=sdist["url"],
            tree=sdist["tree"],
        )


def cache_dir() -> Path:
    """``${BATON_CACHE:-$HOME/.cache/baton}``."""
    value = os.environ.get("BATON_CACHE")
    return Path(value) if value else Path.home() / ".cache" / "baton"


def sdist_path(manifest: Manifest, cache: Path | None = None) -> Path:
    return (cache if cache is not None else cache_dir()) / "sdist" / manifest.filename


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# --- the patch series -------------------------------------------------------------------------


def patch_files(patches_dir: Path = PATCHES_DIR) -> list[Path]:
    """The series, in application order (sorted by file name: ``NNNN-*.patch``)."""
    if not patches_dir.is_dir():
        return []
    return sorted(p for p in patches_dir.glob("*.patch") if p.is_file())


def patch_series_sha256(patches_dir: Path = PATCHES_DIR) -> str:
    """sha256 over the concatenated bytes of the patch files in series order.

    Part of the recipe: two builds with the same pin and the same series hash run the same code.
    An empty series hashes to sha256 of the empty string.
    """
    digest = hashlib.sha256()
    for patch in patch_files(patches_dir):
        digest.update(patch.read_bytes())
    return digest.hexdigest()


def _git(args: list[str], tree: Path) -> subprocess.CompletedProcess[str]:
    # The tree usually sits inside this repository (build/ is ignored). Without a ceiling, git
    # would find the outer repository, read patch paths relative to *its* root and silently skip
    # every path outside the cwd: a "successful" apply that changed nothing.
    env = dict(os.environ)
    env["GIT_CEILING_DIRECTORIES"] = str(tree.resolve().parent)
    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        env.pop(var, None)
    return subprocess.run(["git", *args], cwd=tree, env=env, capture_output=True, text=True, check=False)


def apply_patch(tree: Path, patch: Path, *, reverse: bool = False) -> None:
    """``git apply --check`` then ``git apply`` (``-R`` for reverse) of one patch inside tree."""
    flags = ["-R"] if reverse else []
    verb = "reverse" if reverse else "apply"
    checked = _git(["apply", "--check", *flags, str(patch.resolve())], tree)
    if checked.returncode != 0:
        raise PatchError(patch, f"{verb} (--check)", checked.stderr or checked.stdout)
    applied = _git(["apply", *flags, str(patch.resolve())], tree)
    if applied.returncode != 0:
        raise PatchError(patch, verb, applied.stderr or applied.stdout)


def apply_series(tree: Path, patches: list[Path]) -> None:
    for patch in patches:
        apply_patch(tree, patch)


# --- the sdist --------------------------------------------------------------------------------


def verify_sdist(path: Path, manifest: Manifest) -> None:
    """Raise HashMismatchError unless path's sha256 is the pinned one."""
    if not path.is_file():
        raise SourceError(f"{path} is missing; run `python packaging/llama_source.py prepare`")
    actual = sha256_file(path)
    if actual != manifest.sha256:
        raise HashMismatchError(path, manifest.sha256, actual)


def download(url: str, dest: Path, *, timeout_s: float = DOWNLOAD_TIMEOUT_S) -> None:
    """Download url to dest through a temporary name in the same directory, then rename."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            request = urllib.request.Request(url, headers={"User-Agent": "baton-llama-source/1"})
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                shutil.copyfileobj(response, out, _CHUNK_BYTES)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache is shared like any download
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def ensure_sdist(manifest: Manifest, cache: Path | None = None, *, allow_download: bool = True) -> Path:
    """The verified sdist in the cache, downloading it first when absent.

    A cached file with the wrong hash is moved aside (``*.rejected``) and refused: the next run
    downloads a fresh copy. A freshly downloaded file with the wrong hash is refused the same way.
    """
    path = sdist_path(manifest, cache)
    downloaded = False
    if not path.is_file():
        if not allow_download:
            raise SourceError(f"{path} is missing and downloads are disabled")
        print(f"downloading {manifest.url}", file=sys.stderr)
        try:
            download(manifest.url, path)
        except OSError as e:
            raise SourceError(f"download of {manifest.url} failed: {e}") from e
        downloaded = True
    try:
        verify_sdist(path, manifest)
    except HashMismatchError as e:
        aside = path.with_name(path.name + ".rejected")
        os.replace(path, aside)
        origin = f"downloaded from {manifest.url}" if downloaded else "cached copy"
        raise HashMismatchError(path, e.expected, e.actual, f"{origin}; moved aside to {aside}") from None
    return path


def _member_relpath(name: str, prefix: PurePosixPath) -> PurePosixPath | None:
    """The member's path inside the tree, None for members outside it; refuses unsafe paths."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise SourceError(f"unsafe path in sdist: {name!r}")
    try:
        rel = path.relative_to(prefix)
    except ValueError:
        return None
    return rel if rel.parts else None


def sdist_submodule_commit(sdist: Path, manifest: Manifest) -> str | None:
    """The commit recorded for the vendored submodule inside the sdist, if the sdist carries it."""
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts
            if parts[1:] == (".git", "modules", *PurePosixPath(manifest.tree).parts, "HEAD"):
                f = tar.extractfile(member)
                return f.read().decode().strip() if f else None
    return None


def extract_tree(sdist: Path, manifest: Manifest, dest: Path) -> None:
    """Extract the sdist's ``manifest.tree`` (e.g. vendor/llama.cpp) into dest, which must not exist.

    Only regular files and directories are written (the pinned sdist holds nothing else); paths
    are validated, so a hostile archive cannot write outside dest. The submodule's ``.git``
    pointer file is dropped: it points into the sdist's own .git, which is not extracted.
    """
    top = None
    dest.mkdir(parents=True)
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts
            if top is None:
                top = parts[0]
            rel = _member_relpath(member.name, PurePosixPath(top, manifest.tree))
            if rel is None:
                continue
            if rel == PurePosixPath(".git"):
                continue
            target = dest.joinpath(*rel.parts)
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
            elif member.isfile():
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                with open(target, "wb") as out:
                    shutil.copyfileobj(source, out, _CHUNK_BYTES)
                os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)
            else:
                raise SourceError(f"unsupported member type in sdist: {member.name!r}")
    if not (dest / "CMakeLists.txt").is_file():
        raise SourceError(f"{sdist} has no {manifest.tree}/CMakeLists.txt")


def _carry_mtimes(new_tree: Path, old_tree: Path | None) -> None:
    """Keep the old mtime of files whose bytes did not change; stamp every other file with now.

    Archive mtimes are old: a file that a removed patch had changed would return to an mtime
    older than its object file, and make would keep the stale object. Files proven identical
    keep their mtime, so changing one patch rebuilds only what it touches.
    """
    now = time.time()
    for root, _dirs, files in os.walk(new_tree):
        for name in files:
            new_file = Path(root, name)
            keep = None
            if old_tree is not None:
                old_file = old_tree / new_file.relative_to(new_tree)
                try:
                    old_stat = old_file.stat()
                    if old_stat.st_size == new_file.stat().st_size and (old_file.read_bytes() == new_file.read_bytes()):
                        keep = old_stat.st_mtime_ns
                except OSError:
                    keep = None
            if keep is None:
                os.utime(new_file, (now, now))
            else:
                os.utime(new_file, ns=(keep, keep))


# --- commands ---------------------------------------------------------------------------------


def stamp_for(manifest: Manifest, patches_dir: Path = PATCHES_DIR) -> dict[str, str]:
    return {"sdist_sha256": manifest.sha256, "patch_series_sha256": patch_series_sha256(patches_dir)}


def read_stamp(build_dir: Path = BUILD_DIR) -> dict[str, str] | None:
    try:
        return json.loads((build_dir / "llama.cpp.stamp").read_text())
    except (OSError, ValueError):
        return None


def prepare(
    manifest: Manifest,
    *,
    cache: Path | None = None,
    build_dir: Path = BUILD_DIR,
    patches_dir: Path = PATCHES_DIR,
) -> bool:
    """Make ``build_dir/llama.cpp`` the pinned tree with the series applied. True if it changed.

    Idempotent: when the stamp already records this sdist and this series, nothing is read.
    The new tree is built beside the old one and swapped in; the stamp is written last, so an
    interrupted run is redone by the next one.
    """
    tree = build_dir / "llama.cpp"
    stamp_path = build_dir / "llama.cpp.stamp"
    wanted = stamp_for(manifest, patches_dir)
    if tree.is_dir() and read_stamp(build_dir) == wanted:
        return False

    sdist = ensure_sdist(manifest, cache)
    build_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".llama.cpp.", dir=build_dir))
    try:
        new_tree = scratch / "llama.cpp"
        extract_tree(sdist, manifest, new_tree)
        apply_series(new_tree, patch_files(patches_dir))
        _carry_mtimes(new_tree, tree if tree.is_dir() else None)
        stamp_path.unlink(missing_ok=True)
        if tree.exists():
            shutil.rmtree(tree)
        os.replace(new_tree, tree)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    stamp_path.write_text(json.dumps(wanted, indent=2, sort_keys=True) + "\n")
    return True


def tree_digest(tree: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under tree."""
    digests = {}
    for root, _dirs, files in os.walk(tree):
        for name in files:
            path = Path(root, name)
            digests[path.relative_to(tree).as_posix()] = sha256_file(path)
    return digests


def check_patches(
    manifest: Manifest,
    *,
    cache: Path | None = None,
    patches_dir: Path = PATCHES_DIR,
    work_dir: Path | None = None,
) -> list[Path]:
    """On a fresh pristine copy: every patch checks and applies in order, then the whole series
    checks and reverses in reverse order, leaving the tree byte-identical to pristine.

    Raises PatchError naming the failing patch. Returns the series that was checked.
    """
    sdist = ensure_sdist(manifest, cache)
    patches = patch_files(patches_dir)
    with tempfile.TemporaryDirectory(prefix="baton-check-patches.", dir=work_dir) as tmp:
        tree = Path(tmp) / "llama.cpp"
        extract_tree(sdist, manifest, tree)
        pristine = tree_digest(tree)
        for patch in patches:
            apply_patch(tree, patch)
        if patches and tree_digest(tree) == pristine:
            raise PatchError(patches[0], "change the tree", "the series applied but changed no file")
        for patch in reversed(patches):
            apply_patch(tree, patch, reverse=True)
        after = tree_digest(tree)
        if after != pristine:
            changed = sorted(set(after.items()) ^ set(pristine.items()))
            raise PatchError(
                patches[-1], "reverse to pristine", f"{len(changed)} differing entries, e.g. {changed[0][0]}"
            )
    return patches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["prepare", "verify", "check-patches", "series-hash", "commit"])
    args = parser.parse_args(argv)
    try:
        manifest = Manifest.load()
        if args.command == "prepare":
            changed = prepare(manifest)
            state = "prepared" if changed else "up to date"
            print(
                f"build/llama.cpp {state} (commit {manifest.commit[:12]}, "
                f"{len(patch_files())} patches, series {patch_series_sha256()[:12]})"
            )
        elif args.command == "verify":
            path = sdist_path(manifest)
            verify_sdist(path, manifest)
            commit = sdist_submodule_commit(path, manifest)
            if commit is not None and commit != manifest.commit:
                raise SourceError(f"{path} vendors llama.cpp {commit}, but the manifest pins {manifest.commit}")
            print(f"{path}: sha256 ok ({manifest.sha256})")
        elif args.command == "check-patches":
            patches = check_patches(manifest)
            print(f"{len(patches)} patches apply, check and reverse cleanly")
        elif args.command == "series-hash":
            print(patch_series_sha256())
        elif args.command == "commit":
            print(manifest.commit)
    except SourceError as e:
        print(f"llama_source: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
