"""The relay's durable state: one SQLite file (stdlib ``sqlite3``).

Owns the tables and every query on them: API keys (only the sha256 of each key is stored; the
key itself is shown once, by ``create_key``), each key's limits, token usage per UTC day, the
recent requests the per-minute limit counts, and the ledger (each node's rows and credit per
completion). Usage is keyed by the key's *name*, so a key re-issued under a revoked key's name
keeps its usage; anonymous access is the pseudo-key ``ANONYMOUS`` ("anonymous"), which has no
key row (the server passes its limits) but whose usage is stored like any other.

Must not import trio: the decisions are in ``agent.core.relay.quotas`` (limits, credit arithmetic),
and the server performs them around this store.

Schema: versioned with ``PRAGMA user_version`` (``RELAY_SCHEMA_VERSION``) and marked as a relay
database with ``PRAGMA application_id`` (``RELAY_APPLICATION_ID``), so a tracker database or
another file is refused by name rather than misread. An older version is migrated on open
(``_MIGRATIONS``).

The relay's secrets live here too: the random secret its prefix salts are derived from
(``prefix_salt_secret``; ``agent.core.relay.prefix_salt``), made when the file is created or
migrated, and read by no request.

File mode: created 0600 (the WAL and shared-memory files SQLite creates next to it take the
same mode); an existing file that group or others may access is refused, as key files are.

Threading: synchronous, called on the server's trio thread. Every call is a primary-key
lookup, an index range scan or a small insert on a local file, and commits in WAL mode with
``synchronous=NORMAL`` append to the WAL without an fsync, so a call takes well under a
millisecond (the tracker store's reasoning, see ``agent.io.tracker.store``). Another process
(``baton relay keys add`` while the server runs) may use the same file: writers wait up to
``busy_timeout_s`` for each other. Durability: a committed transaction survives the process
being killed; a power cut may lose the last few commits.

Resource handling: ``open_relay_store(path)`` is a context manager that closes the connection;
``RelayStore.open(path)`` / ``close()`` for callers that manage it themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import os
import re
import secrets
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from agent.core.relay.prefix_salt import SECRET_BYTES
from agent.core.relay.quotas import RPM_WINDOW_S, KeyLimits, credit_for_hops
from agent.io import sqlite_db

__all__ = [
    "ANONYMOUS",
    "API_KEY_PREFIX",
    "RELAY_APPLICATION_ID",
    "RELAY_SCHEMA_VERSION",
    "DayUsage",
    "KeyExistsError",
    "KeyRecord",
    "LedgerEntry",
    "RelayStore",
    "StoreError",
    "hash_api_key",
    "open_relay_store",
]

RELAY_SCHEMA_VERSION = 2
#: ``PRAGMA application_id`` of a relay database: b"BtRl".
RELAY_APPLICATION_ID = int.from_bytes(b"BtRl", "big")
#: Every API key starts with this; the rest is ``secrets.token_urlsafe(32)`` (256 random bits).
API_KEY_PREFIX = "sk-baton-"
#: The pseudo-key of requests without an API key (usage only; no key row, no key).
ANONYMOUS = "anonymous"

_FILE_MODE = 0o600
_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_DAY_PATTERN = re.compile(r"\d{4}-\d{2}-\d{2}")

_SCHEMA = """
CREATE TABLE api_keys (
    key_sha256 TEXT PRIMARY KEY,         -- hex sha256 of the key text (the key is never stored)
    name TEXT NOT NULL,
    tokens_per_day INTEGER,              -- NULL: unlimited (same for the next two)
    requests_per_minute INTEGER,
    max_concurrent INTEGER,
    created_at_s REAL NOT NULL,
    revoked_at_s REAL,                   -- NULL: live
    -- (version 2) 1: its prompts share the hops' prefix caches with every other such key's
    shareable_prefixes INTEGER NOT NULL DEFAULT 0
);
-- One live key per name. Revoked keys keep their rows (authenticate says "revoked").
CREATE UNIQUE INDEX api_keys_live_name ON api_keys (name) WHERE revoked_at_s IS NULL;
CREATE TABLE usage (
    name TEXT NOT NULL,                  -- key name, or 'anonymous'
    day TEXT NOT NULL,                   -- UTC day, YYYY-MM-DD
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    PRIMARY KEY (name, day)
);
CREATE TABLE requests (                  -- only the last RPM_WINDOW_S seconds are kept
    name TEXT NOT NULL,
    at_s REAL NOT NULL
);
CREATE INDEX requests_by_name ON requests (name, at_s);
CREATE INDEX requests_by_time ON requests (at_s);
CREATE TABLE completions (               -- one row per credited completion: the idempotency key
    completion_id TEXT PRIMARY KEY,
    model_sha256 TEXT NOT NULL,
    n_layer INTEGER NOT NULL,
    credited_at_s REAL NOT NULL
);
CREATE TABLE credits (
    completion_id TEXT NOT NULL REFERENCES completions (completion_id),
    position INTEGER NOT NULL,           -- order of the node's first hop on the route
    peer_id TEXT NOT NULL,
    rows INTEGER NOT NULL,
    credit REAL NOT NULL,                -- rows * (end - begin) / n_layer, summed over its hops
    PRIMARY KEY (completion_id, peer_id)
);
CREATE INDEX credits_by_peer ON credits (peer_id);
"""
_SECRETS_TABLE = """
CREATE TABLE secrets (                   -- (version 2) the relay's own secrets, by purpose
    purpose TEXT PRIMARY KEY,
    secret BLOB NOT NULL
)"""
_SCHEMA += _SECRETS_TABLE + ";\n"

#: version -> statements that bring a file of that version to the next one (each migration
#: also makes the secrets the new version keeps: ``_make_secrets``)
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: ("ALTER TABLE api_keys ADD COLUMN shareable_prefixes INTEGER NOT NULL DEFAULT 0", _SECRETS_TABLE),
}
_PREFIX_SALT = "prefix_salt"


class StoreError(Exception):
    """The database file cannot be used (not a relay database, another schema version, or a
    file mode that lets group or others read it)."""


class KeyExistsError(StoreError):
    """A live key already has this name (revoke it first, or pick another name)."""


@dataclasses.dataclass(frozen=True)
class KeyRecord:
    """One API key as stored (never the key itself)."""

    name: str
    limits: KeyLimits
    created_at_s: float
    revoked: bool
    key_sha256: str = ""  # the key's id (what the store keeps of it)
    shareable_prefixes: bool = False  # its prompts share the prefix caches with other such keys'


@dataclasses.dataclass(frozen=True)
class DayUsage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """One node's rows and credit, over ``completions`` completions."""

    peer_id: str
    rows: int
    credit: float
    completions: int


def hash_api_key(api_key: str) -> str:
    """The hex sha256 of the key text (what the store keeps)."""
    # surrogatepass: any str a header decoder produced hashes (and then simply matches nothing).
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"key name {name!r} must be 1-64 characters of letters, digits and . _ @ -, starting with a letter or digit"
        )


def _check_count(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an int >= 0, got {value!r}")


def _check_time(what: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")


def _check_day(day: str) -> None:
    if not isinstance(day, str) or not _DAY_PATTERN.fullmatch(day):
        raise ValueError(f"day must be YYYY-MM-DD, got {day!r}")


class RelayStore(sqlite_db.SqliteStore):
    """Queries over one relay database. Not thread-safe: use from one thread."""

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, busy_timeout_s: float = 5.0) -> RelayStore:
        """Open (creating if needed, mode 0600, parent directories 0700) the database at ``path``.

        Raises:
          StoreError: the file is not a relay database, holds another schema version, or may
            be accessed by group or others.
          sqlite3.Error / OSError: the file cannot be opened.
        """
        path = Path(path)
        try:
            connection = sqlite_db.connect(
                path, busy_timeout_s=busy_timeout_s,
                not_a_database=lambda error: StoreError(f"{path}: not a Baton relay database ({error})"),
            )  # fmt: skip
        except sqlite_db.DatabaseNotPrivate as error:
            raise StoreError(f"relay {error}") from None
        return cls._adopt(connection, path)

    def _migrate(self) -> None:
        # Inside one write transaction: two processes creating (or migrating) the same file do
        # not both do it.
        with self._transaction() as db:
            application_id = db.execute("PRAGMA application_id").fetchone()[0]
            version = db.execute("PRAGMA user_version").fetchone()[0]
            tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            if application_id == 0 and version == 0 and tables == 0:
                for statement in _SCHEMA.split(";\n"):  # no statement or comment holds ";\n"
                    if statement.strip():
                        db.execute(statement)
                _make_secrets(db)
                # PRAGMA arguments cannot be bound; both are int constants of this module.
                db.execute(f"PRAGMA application_id = {RELAY_APPLICATION_ID:d}")
                db.execute(f"PRAGMA user_version = {RELAY_SCHEMA_VERSION:d}")
                return
            if application_id != RELAY_APPLICATION_ID:
                raise StoreError(f"{self.path}: not a Baton relay database (application_id {application_id:#x})")
            if version != RELAY_SCHEMA_VERSION and version in _MIGRATIONS:
                while version != RELAY_SCHEMA_VERSION:
                    for statement in _MIGRATIONS[version]:
                        db.execute(statement)
                    version += 1
                _make_secrets(db)
                db.execute(f"PRAGMA user_version = {RELAY_SCHEMA_VERSION:d}")
        if version != RELAY_SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: relay database schema version {version}, this relay speaks {RELAY_SCHEMA_VERSION}"
            )

    @functools.cached_property
    def prefix_salt_secret(self) -> bytes:
        """The relay's secret its prefix salts are derived from (``agent.core.relay.prefix_salt``):
        made with the file, the same for every process that opens it."""
        (secret,) = self._db.execute("SELECT secret FROM secrets WHERE purpose = ?", (_PREFIX_SALT,)).fetchone()
        return bytes(secret)

    # --- API keys -----------------------------------------------------------------------------

    def create_key(
        self, name: str, limits: KeyLimits, *, shareable_prefixes: bool = False, now_s: float | None = None
    ) -> str:
        """Create a key named ``name`` and return it: the only time it exists in clear.

        ``shareable_prefixes``: its requests' prompt prefixes share the hops' prefix caches with
        every other key so marked (``agent.core.relay.prefix_salt``); by default only its own.

        Raises:
          KeyExistsError: a live key has this name.
          ValueError: the name is malformed or is the reserved ``"anonymous"``.
        """
        _check_name(name)
        if name == ANONYMOUS:
            raise ValueError(f"key name {ANONYMOUS!r} is reserved for requests without a key")
        created_at_s = time.time() if now_s is None else now_s
        _check_time("now_s", created_at_s)
        api_key = API_KEY_PREFIX + secrets.token_urlsafe(32)
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM api_keys WHERE name = ? AND revoked_at_s IS NULL", (name,)).fetchone():
                raise KeyExistsError(f"a key named {name!r} already exists (revoke it first)")
            db.execute(
                "INSERT INTO api_keys (key_sha256, name, tokens_per_day, requests_per_minute, max_concurrent, "
                "created_at_s, shareable_prefixes) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    hash_api_key(api_key),
                    name,
                    limits.tokens_per_day,
                    limits.requests_per_minute,
                    limits.max_concurrent,
                    created_at_s,
                    int(bool(shareable_prefixes)),
                ),
            )
        return api_key

    def authenticate(self, api_key: str) -> KeyRecord | None:
        """The key's record (``revoked=True`` for a revoked key), or None for an unknown key."""
        row = self._db.execute(
            f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE key_sha256 = ?", (hash_api_key(api_key),)
        ).fetchone()
        return None if row is None else _key_record(row)

    def revoke_key(self, name: str, *, now_s: float | None = None) -> bool:
        """Revoke the live key named ``name``; False if there is none."""
        revoked_at_s = time.time() if now_s is None else now_s
        _check_time("now_s", revoked_at_s)
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE api_keys SET revoked_at_s = ? WHERE name = ? AND revoked_at_s IS NULL", (revoked_at_s, name)
            )
            return cursor.rowcount > 0

    def set_shareable_prefixes(self, name: str, shareable: bool) -> bool:
        """Mark the live key named ``name`` shareable (or private again); False if there is none.
        Its requests from then on use the new salt: what it cached before is not reused."""
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE api_keys SET shareable_prefixes = ? WHERE name = ? AND revoked_at_s IS NULL",
                (int(bool(shareable)), name),
            )
            return cursor.rowcount > 0

    def list_keys(self) -> list[KeyRecord]:
        """Every key, revoked ones included, by name then creation time."""
        rows = self._db.execute(f"SELECT {_KEY_COLUMNS} FROM api_keys ORDER BY name, created_at_s, key_sha256")
        return [_key_record(row) for row in rows]

    # --- usage --------------------------------------------------------------------------------

    def add_usage(self, name: str, day: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Add tokens to ``name``'s usage on UTC ``day`` (``quotas.day_of(now_s)``)."""
        _check_day(day)
        _check_count("prompt_tokens", prompt_tokens)
        _check_count("completion_tokens", completion_tokens)
        with self._transaction() as db:
            db.execute(
                "INSERT INTO usage (name, day, prompt_tokens, completion_tokens) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (name, day) DO UPDATE SET "
                "prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                "completion_tokens = completion_tokens + excluded.completion_tokens",
                (name, day, prompt_tokens, completion_tokens),
            )

    def usage_on(self, name: str, day: str) -> DayUsage:
        """``name``'s prompt and completion tokens on UTC ``day`` (zeros when none)."""
        row = self._db.execute(
            "SELECT prompt_tokens, completion_tokens FROM usage WHERE name = ? AND day = ?", (name, day)
        ).fetchone()
        return DayUsage(0, 0) if row is None else DayUsage(row[0], row[1])

    def tokens_on(self, name: str, day: str) -> int:
        """Prompt + completion tokens ``name`` used on UTC ``day`` (what ``tokens_per_day`` counts)."""
        return self.usage_on(name, day).total_tokens

    def record_request(self, name: str, now_s: float) -> None:
        """Count one request of ``name`` at ``now_s``; forget every request older than the window."""
        _check_time("now_s", now_s)
        with self._transaction() as db:
            db.execute("DELETE FROM requests WHERE at_s <= ?", (now_s - RPM_WINDOW_S,))
            db.execute("INSERT INTO requests (name, at_s) VALUES (?, ?)", (name, now_s))

    def requests_since(self, name: str, since_s: float) -> list[float]:
        """The times of ``name``'s requests strictly after ``since_s``, oldest first."""
        rows = self._db.execute(
            "SELECT at_s FROM requests WHERE name = ? AND at_s > ? ORDER BY at_s", (name, since_s)
        ).fetchall()
        return [row[0] for row in rows]

    # --- ledger -------------------------------------------------------------------------------

    def credit(
        self,
        completion_id: str,
        model_sha256: str,
        hops: Sequence[tuple[str, int, int, int]],
        n_layer: int,
        now_s: float,
    ) -> bool:
        """Credit each node of one completion (``quotas.credit_for_hops``), once per completion.

        ``hops``: ``(peer_id, begin, end, rows)`` per hop. Returns False, changing nothing,
        when ``completion_id`` was already credited (a retried call after a crash is safe).

        Raises:
          ValueError: empty ids, or hops ``credit_for_hops`` refuses (nothing is stored).
        """
        if not isinstance(completion_id, str) or not completion_id:
            raise ValueError(f"completion_id must be a non-empty str, got {completion_id!r}")
        if not isinstance(model_sha256, str) or not model_sha256:
            raise ValueError(f"model_sha256 must be a non-empty str, got {model_sha256!r}")
        _check_time("now_s", now_s)
        credits = credit_for_hops(hops, n_layer)
        with self._transaction() as db:
            cursor = db.execute(
                "INSERT OR IGNORE INTO completions (completion_id, model_sha256, n_layer, credited_at_s) "
                "VALUES (?, ?, ?, ?)",
                (completion_id, model_sha256, n_layer, now_s),
            )
            if cursor.rowcount == 0:
                return False
            db.executemany(
                "INSERT INTO credits (completion_id, position, peer_id, rows, credit) VALUES (?, ?, ?, ?, ?)",
                [(completion_id, i, c.peer_id, c.rows, c.credit) for i, c in enumerate(credits)],
            )
        return True

    def ledger(self) -> list[LedgerEntry]:
        """Every node's total rows, credit and completions, most credit first (then peer id)."""
        rows = self._db.execute(
            "SELECT peer_id, SUM(rows), SUM(credit), COUNT(*) FROM credits "
            "GROUP BY peer_id ORDER BY SUM(credit) DESC, peer_id"
        )
        return [LedgerEntry(r[0], r[1], r[2], r[3]) for r in rows]

    def ledger_for(self, completion_id: str) -> list[LedgerEntry]:
        """The nodes credited for one completion, in route order (empty if never credited)."""
        rows = self._db.execute(
            "SELECT peer_id, rows, credit FROM credits WHERE completion_id = ? ORDER BY position", (completion_id,)
        )
        return [LedgerEntry(r[0], r[1], r[2], 1) for r in rows]


_KEY_COLUMNS = (
    "name, tokens_per_day, requests_per_minute, max_concurrent, created_at_s, revoked_at_s, key_sha256, "
    "shareable_prefixes"
)


def _key_record(row) -> KeyRecord:
    return KeyRecord(
        name=row[0],
        limits=KeyLimits(tokens_per_day=row[1], requests_per_minute=row[2], max_concurrent=row[3]),
        created_at_s=row[4],
        revoked=row[5] is not None,
        key_sha256=row[6],
        shareable_prefixes=bool(row[7]),
    )


def _make_secrets(db) -> None:
    """Make the secrets the current schema keeps that the file lacks (in the caller's transaction)."""
    db.execute(
        "INSERT OR IGNORE INTO secrets (purpose, secret) VALUES (?, ?)",
        (_PREFIX_SALT, secrets.token_bytes(SECRET_BYTES)),
    )


@contextlib.contextmanager
def open_relay_store(path: str | os.PathLike[str], *, busy_timeout_s: float = 5.0) -> Iterator[RelayStore]:
    """``RelayStore.open(path)``, closed on exit."""
    store = RelayStore.open(path, busy_timeout_s=busy_timeout_s)
    try:
        yield store
    finally:
        store.close()
