"""The node's identity key on disk: one Ed25519 key, the same for signatures and for libp2p.

Owns: loading and creating the key file (the raw 32-byte private seed, mode 0600, in a 0700
directory when this module creates the directory) and refusing a key file that others can read
or that is not a seed. Must not import trio or libp2p: the transport converts the key itself.

Resource handling: the file is written to a temporary name in the same directory, flushed,
fsynced and renamed into place, so a crash never leaves a truncated key behind; two processes
creating the same key at once both end up using the one that won the rename.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.core.net.identity import ED25519_KEY_BYTES, peer_id_from_public_key

__all__ = ["KeyFileError", "load_or_create_key", "peer_id_of", "private_seed", "public_key_bytes"]

_KEY_FILE_MODE = 0o600
_KEY_DIR_MODE = 0o700


class KeyFileError(Exception):
    """The key file exists but must not be used (readable by others, or not a 32-byte seed)."""


def load_or_create_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The Ed25519 key stored at ``path``, creating it (mode 0600) if the file does not exist.

    Raises:
        KeyFileError: the file is readable or writable by group/others, is not a regular file,
            or does not hold exactly 32 bytes.
        OSError: the file or its directory cannot be read or written.
    """
    key_path = Path(path)
    try:
        return _load(key_path)
    except FileNotFoundError:
        pass
    if not key_path.parent.exists():
        key_path.parent.mkdir(mode=_KEY_DIR_MODE, parents=True, exist_ok=True)
    _create(key_path)
    return _load(key_path)


def private_seed(key: Ed25519PrivateKey) -> bytes:
    """The raw 32-byte private seed (what the key file holds)."""
    return key.private_bytes(
        encoding=serialization.Encoding.Raw,
        format=serialization.PrivateFormat.Raw,
        encryption_algorithm=serialization.NoEncryption(),
    )


def public_key_bytes(key: Ed25519PrivateKey) -> bytes:
    """The raw 32-byte public key (what goes on the wire)."""
    return key.public_key().public_bytes(encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw)


def peer_id_of(key: Ed25519PrivateKey) -> str:
    """The libp2p peer id of ``key`` (base58), as ``agent.core.net.identity`` computes it."""
    return peer_id_from_public_key(public_key_bytes(key))


def _load(key_path: Path) -> Ed25519PrivateKey:
    # O_NOFOLLOW: a symlink planted at the key path is refused rather than followed.
    fd = os.open(key_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"key file {key_path} is not a regular file")
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(
                f"key file {key_path} has mode {stat.S_IMODE(info.st_mode):04o}; it must not be "
                f"accessible by group or others (chmod 600 {key_path})"
            )
        seed = os.read(fd, ED25519_KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(seed) != ED25519_KEY_BYTES:
        raise KeyFileError(
            f"key file {key_path} holds {len(seed)}{'+' if len(seed) > ED25519_KEY_BYTES else ''} bytes; "
            f"expected a raw {ED25519_KEY_BYTES}-byte Ed25519 seed"
        )
    return Ed25519PrivateKey.from_private_bytes(seed)


def _create(key_path: Path) -> None:
    seed = private_seed(Ed25519PrivateKey.generate())
    temporary = key_path.with_name(f".{key_path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _KEY_FILE_MODE)
    try:
        os.fchmod(fd, _KEY_FILE_MODE)  # the umask may have taken bits away; never adds any
        os.write(fd, seed)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        temporary.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        # link() fails if another process created the key meanwhile: theirs wins, ours goes.
        os.link(temporary, key_path)
    except FileExistsError:
        pass
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_directory(key_path.parent)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
