"""The identity key file: created 0600 in a 0700 directory, reused, refused when unsafe."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from libp2p.crypto.ed25519 import Ed25519PrivateKey as Libp2pEd25519PrivateKey
from libp2p.peer.id import ID

from agent.core.net.identity import peer_id_from_public_key
from agent.io.keys import KeyFileError, load_or_create_key, peer_id_of, private_seed, public_key_bytes

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_created_with_mode_0600_in_a_new_0700_directory(tmp_path: Path) -> None:
    path = tmp_path / "state" / "node.key"
    key = load_or_create_key(path)
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700
    assert path.read_bytes() == private_seed(key)
    assert len(path.read_bytes()) == 32
    assert [entry.name for entry in path.parent.iterdir()] == ["node.key"]  # no temporary left


def test_second_call_reuses_the_key(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    first = load_or_create_key(path)
    second = load_or_create_key(path)
    assert peer_id_of(first) == peer_id_of(second)
    assert public_key_bytes(first) == public_key_bytes(second)


def test_distinct_files_give_distinct_keys(tmp_path: Path) -> None:
    assert peer_id_of(load_or_create_key(tmp_path / "a.key")) != peer_id_of(load_or_create_key(tmp_path / "b.key"))


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_refused_when_readable_by_others(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "node.key"
    load_or_create_key(path)
    os.chmod(path, mode)
    with pytest.raises(KeyFileError, match="must not be accessible by group or others"):
        load_or_create_key(path)


@pytest.mark.parametrize("size", [0, 31, 33, 64])
def test_refused_when_not_a_32_byte_seed(tmp_path: Path, size: int) -> None:
    path = tmp_path / "node.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"\1" * size)
    os.close(fd)
    with pytest.raises(KeyFileError, match="expected a raw 32-byte Ed25519 seed"):
        load_or_create_key(path)
    assert path.read_bytes() == b"\1" * size  # never overwritten


def test_refused_when_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "real.key"
    load_or_create_key(target)
    link = tmp_path / "node.key"
    link.symlink_to(target)
    with pytest.raises(OSError):
        load_or_create_key(link)


def test_peer_id_matches_libp2p(tmp_path: Path) -> None:
    key = load_or_create_key(tmp_path / "node.key")
    libp2p_key = Libp2pEd25519PrivateKey.new(private_seed(key))
    libp2p_peer_id = ID.from_pubkey(libp2p_key.get_public_key()).to_base58()
    assert peer_id_of(key) == libp2p_peer_id
    assert peer_id_from_public_key(public_key_bytes(key)) == libp2p_peer_id
    assert libp2p_key.get_public_key().to_bytes() == public_key_bytes(key)
    assert libp2p_peer_id.startswith("12D3KooW")  # the identity-multihash form for Ed25519
