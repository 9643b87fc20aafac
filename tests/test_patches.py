"""The patch series in patches/: it applies, checks and reverses cleanly on the pristine tree.

Works with an empty series too: the pristine tree must still extract from the pinned sdist.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.worker

REPO_ROOT = Path(__file__).resolve().parent.parent
PATCH_NAME = re.compile(r"^\d{4}-[A-Za-z0-9][A-Za-z0-9._-]*\.patch$")


def test_pristine_tree_extracts(llama_source, tmp_path):
    manifest = llama_source.Manifest.load()
    tree = tmp_path / "llama.cpp"

    llama_source.extract_tree(llama_source.ensure_sdist(manifest), manifest, tree)

    for required in ("CMakeLists.txt", "include/llama.h", "src/llama-model.cpp", "ggml/include/ggml.h"):
        assert (tree / required).is_file(), required
    assert not (tree / ".git").exists()


def test_series_is_numbered(llama_source):
    patches = llama_source.patch_files(REPO_ROOT / "patches")
    names = [p.name for p in patches]

    assert [n for n in names if not PATCH_NAME.match(n)] == []
    numbers = [int(n[:4]) for n in names]
    assert numbers == sorted(set(numbers)), "patch numbers must be unique"


def test_series_applies_checks_and_reverses(llama_source, tmp_path):
    manifest = llama_source.Manifest.load()
    expected = llama_source.patch_files(REPO_ROOT / "patches")

    # Raises PatchError naming the first patch that fails to apply or reverse.
    checked = llama_source.check_patches(manifest, patches_dir=REPO_ROOT / "patches", work_dir=tmp_path)

    assert checked == expected


def test_series_hash_is_sha256_of_concatenated_patches(llama_source, tmp_path):
    assert llama_source.patch_series_sha256(tmp_path) == hashlib.sha256(b"").hexdigest()
    (tmp_path / "0002-b.patch").write_bytes(b"second\n")
    (tmp_path / "0001-a.patch").write_bytes(b"first\n")
    (tmp_path / "README").write_bytes(b"not a patch\n")

    assert llama_source.patch_series_sha256(tmp_path) == hashlib.sha256(b"first\nsecond\n").hexdigest()


TOY_PATCH = textwrap.dedent(
    """\
    From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
    Subject: [PATCH] toy

    ---
     src/a.txt | 1 +
     1 file changed, 1 insertion(+)

    diff --git a/src/a.txt b/src/a.txt
    index 0000000..0000000 100644
    --- a/src/a.txt
    +++ b/src/a.txt
    @@ -1 +1,2 @@
     one
    +two
    """
)


def test_apply_inside_an_enclosing_git_repository_changes_the_tree(llama_source, tmp_path):
    # build/llama.cpp lives inside this repository's checkout. git apply must not resolve patch
    # paths against the enclosing repository (which would silently skip them).
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    tree = tmp_path / "build" / "llama.cpp"
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "a.txt").write_text("one\n")
    patch = tmp_path / "0001-toy.patch"
    patch.write_text(TOY_PATCH)

    llama_source.apply_patch(tree, patch)
    assert (tree / "src" / "a.txt").read_text() == "one\ntwo\n"

    llama_source.apply_patch(tree, patch, reverse=True)
    assert (tree / "src" / "a.txt").read_text() == "one\n"


def test_a_patch_that_does_not_apply_is_named(llama_source, tmp_path):
    tree = tmp_path / "llama.cpp"
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "a.txt").write_text("something else\n")
    patch = tmp_path / "0001-toy.patch"
    patch.write_text(TOY_PATCH)

    with pytest.raises(llama_source.PatchError, match=r"0001-toy.patch"):
        llama_source.apply_patch(tree, patch)

    assert (tree / "src" / "a.txt").read_text() == "something else\n"
