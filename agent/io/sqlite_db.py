"""Opening a SQLite database the way every Baton store does, and its write transactions.

Owns: the connection settings shared by the tracker's and the relay's stores (autocommit off
in favour of explicit ``BEGIN IMMEDIATE`` transactions, write-ahead log, ``synchronous=NORMAL``,
foreign keys on) and the transaction context manager. Each store keeps its own schema and
migrations.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "DatabaseNotPrivate",
    "DatabaseOpenError",
    "SqliteStore",
    "connect",
    "create_private_file",
    "ensure_directory",
    "transaction",
]

_FILE_MODE = 0o600  # a store's database file, when Baton creates it
_DIR_MODE = 0o700  # a store's directory, when Baton creates it


class DatabaseOpenError(OSError):
    """The database file cannot be opened (a directory that cannot be made or written, a path
    that is a directory, no permission): an OSError, so the commands' usual handling reports it."""


class DatabaseNotPrivate(DatabaseOpenError):
    """The database file exists with a mode that lets group or others access it."""


def ensure_directory(path: Path) -> None:
    """Create the directory ``path`` will be in (mode 0700) when it is missing.

    Raises:
      DatabaseOpenError: it cannot be made.
    """
    if path.parent.exists():
        return
    try:
        path.parent.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    except OSError as error:
        raise DatabaseOpenError(f"cannot make the directory for the database {path}: {error}") from None


def connect(
    path: Path,
    *,
    busy_timeout_s: float = 5.0,
    not_a_database: Callable[[sqlite3.DatabaseError], Exception] | None = None,
) -> sqlite3.Connection:
    """A connection to ``path`` (created if missing, and its directory) with the stores' settings.

    ``not_a_database(error)``: the exception to raise when the file is not SQLite at all.

    Raises:
      DatabaseOpenError: the file cannot be opened.
      sqlite3.Error: the file fails later (or what ``not_a_database`` returns).
    """
    create_private_file(path)
    try:
        connection = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None)  # explicit transactions
    except sqlite3.OperationalError as error:  # ("unable to open database file": nothing more from SQLite)
        why = "it is a directory" if path.is_dir() else str(error)
        raise DatabaseOpenError(f"cannot open the database {path}: {why}") from None
    try:
        try:
            connection.execute("PRAGMA journal_mode=WAL")
        except sqlite3.DatabaseError as error:
            if not_a_database is None:
                raise
            raise not_a_database(error) from None
        connection.execute("PRAGMA synchronous=NORMAL")
        connection.execute("PRAGMA foreign_keys=ON")
    except BaseException:
        connection.close()
        raise
    return connection


def create_private_file(path: Path) -> None:
    """Create the database ``path`` empty with mode 0600 unless it exists (SQLite gives its -wal
    and -shm files the database's mode): API key hashes, usage and the node registry are the
    owner's alone. A file that exists with group or other bits is refused, naming the fix.

    Raises:
      DatabaseNotPrivate: it exists and group or others may access it.
      DatabaseOpenError: it cannot be made.
    """
    ensure_directory(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
    except FileExistsError:
        try:
            info = os.stat(path)
        except OSError:
            return  # (gone again, or unreadable: connect says why)
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISREG(info.st_mode) and mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise DatabaseNotPrivate(
                f"database {path} has mode {mode:04o}; it must not be accessible by group or others (chmod 600 {path})"
            ) from None
        return
    except OSError as error:
        raise DatabaseOpenError(f"cannot create the database {path}: {error}") from None
    try:
        os.fchmod(fd, _FILE_MODE)  # the umask may have taken bits away; never adds any
    finally:
        os.close(fd)


@contextlib.contextmanager
def transaction(connection: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction: committed when the block ends, rolled back if it raises.

    ``BEGIN IMMEDIATE`` takes the write lock at once, so two processes never interleave a
    read-then-write (e.g. two creating the same new file's tables).
    """
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield connection
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


class SqliteStore:
    """The part every store shares: its connection and path, closing, write transactions,
    and adopting a fresh connection (migrated, or closed if that fails). A store adds its
    schema (``_migrate``) and queries. Not thread-safe: use from one thread."""

    def __init__(self, connection: sqlite3.Connection, path: Path) -> None:
        self._db = connection
        self.path = path

    @classmethod
    def _adopt(cls, connection: sqlite3.Connection, path: Path):
        """A store over ``connection``, migrated; the connection is closed if that fails."""
        try:
            store = cls(connection, path)
            store._migrate()
        except BaseException:
            connection.close()
            raise
        return store

    def close(self) -> None:
        self._db.close()

    def _transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return transaction(self._db)

    def _migrate(self) -> None:
        raise NotImplementedError
