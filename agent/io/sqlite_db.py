"""Opening a SQLite database the way every Baton store does, and its write transactions.

Owns: the connection settings shared by the tracker's and the relay's stores (autocommit off
in favour of explicit ``BEGIN IMMEDIATE`` transactions, write-ahead log, ``synchronous=NORMAL``,
foreign keys on) and the transaction context manager. Each store keeps its own schema and
migrations.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["SqliteStore", "connect", "transaction"]


def connect(
    path: Path, *, busy_timeout_s: float = 5.0, not_a_database: Callable[[sqlite3.DatabaseError], Exception] | None = None
) -> sqlite3.Connection:
    """A connection to ``path`` (created if missing) with the stores' settings.

    ``not_a_database(error)``: the exception to raise when the file is not SQLite at all.

    Raises:
      sqlite3.Error / OSError: the file cannot be opened (or what ``not_a_database`` returns).
    """
    connection = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None)  # explicit transactions
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
    def _adopt(cls, connection: sqlite3.Connection, path: Path):  # noqa: ANN206 - the subclass
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
