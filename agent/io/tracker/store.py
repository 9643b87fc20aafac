"""The tracker's durable state: one SQLite file (stdlib ``sqlite3``).

Owns the tables and every query on them: nodes (key, signed fingerprint, admission, liveness,
the ranges their last heartbeat reported), clients (admissions), seen registration / hello
nonces, models (``ModelEntry`` and the file it was registered from), assignments and the
status nodes report for them, output integrity (checks failed with their evidence, checks
passed, refusals: they outlive registrations), the ``NodeEntry`` view of all that
(``node_entries``), and the schema version of the file (an older version is migrated on open, see ``_MIGRATIONS``; a
newer one is refused). A tracker restart reopens the file and loses nothing; liveness is
*not* trusted across a restart (the service confirms a node only once it heartbeats again,
see ``service.py``).

Threading: the store is synchronous and is called on the trio thread. Every query is a
primary-key lookup or a scan of a few hundred rows on a local file, and commits in WAL mode
with ``synchronous=NORMAL`` append to the WAL without an fsync, so a call takes well under a
millisecond; handing each one to a worker thread would cost more than it saves and would need
a lock around the connection. Durability: a committed transaction survives the tracker
process being killed; a power cut may lose the last few commits (WAL + NORMAL).

Resource handling: ``open_store(path)`` is a context manager that closes the connection;
``TrackerStore.open(path)`` / ``close()`` for callers that manage it themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

from agent._proto import swarm_pb2
from agent.core.tracker.assignment import Assignment
from agent.core.wire.invites import InviteRow
from agent.io import sqlite_db

__all__ = ["STORE_SCHEMA_VERSION", "AssignmentRow", "NodeRecord", "StoreError", "TrackerStore", "open_store"]

STORE_SCHEMA_VERSION = 5

# (version 4) output integrity: checks failed (the evidence) and passed, and refusals. Kept
# apart from ``nodes``, whose row a registration replaces: these outlive registrations.
_INTEGRITY_TABLES = """
CREATE TABLE integrity_failures (
    peer_id TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    failure BLOB NOT NULL                -- serialized IntegrityFailure
);
CREATE INDEX integrity_failures_by_peer ON integrity_failures (peer_id, at_ms);
CREATE TABLE node_integrity (
    peer_id TEXT PRIMARY KEY,
    checks_passed INTEGER NOT NULL DEFAULT 0,
    refused TEXT NOT NULL DEFAULT ''     -- why the tracker refuses the node ('' while admitted)
);
"""

# (version 5) invites (``--require-invites``): only a token's SHA-256 is kept
_INVITE_TABLE = """
CREATE TABLE invites (
    token_sha256 TEXT PRIMARY KEY,
    uses_left INTEGER NOT NULL,          -- new keys it may still admit
    expires_at_ms INTEGER NOT NULL,      -- 0: never
    note TEXT NOT NULL DEFAULT '',       -- the operator's: whom it was made for
    created_at_ms INTEGER NOT NULL
);
"""

_SCHEMA = (
    """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE nodes (
    peer_id TEXT PRIMARY KEY,
    public_key BLOB NOT NULL,            -- raw Ed25519, 32 bytes
    signed_fingerprint BLOB NOT NULL,    -- serialized SignedFingerprint (fingerprint bytes + signature)
    admission BLOB NOT NULL,             -- serialized SignedAdmission last issued
    admitted_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL,
    last_heartbeat_ms INTEGER NOT NULL,
    alive INTEGER NOT NULL,              -- 0 once declared dead (missed heartbeats)
    listen_addrs TEXT NOT NULL,          -- JSON list, from the last heartbeat (else the fingerprint)
    -- (version 2) what the last heartbeat reported: a serialized NodeEntry holding only serving
    serving BLOB NOT NULL DEFAULT x''
);
CREATE TABLE clients (
    peer_id TEXT PRIMARY KEY,
    public_key BLOB NOT NULL,
    admission BLOB NOT NULL,
    admitted_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL
);
CREATE TABLE seen_nonces (
    peer_id TEXT NOT NULL,
    nonce BLOB NOT NULL,
    seen_at_ms INTEGER NOT NULL,
    PRIMARY KEY (peer_id, nonce)
);
CREATE INDEX seen_nonces_by_time ON seen_nonces (seen_at_ms);
CREATE TABLE models (
    sha256 TEXT PRIMARY KEY,
    alias TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    entry BLOB NOT NULL,                 -- serialized ModelEntry
    registered_at_ms INTEGER NOT NULL,
    -- (version 2) absolute path of the registered GGUF ('' if unknown)
    path TEXT NOT NULL DEFAULT '',
    -- (version 3) an HTTP(S) URL serving the file with range requests ('' if none)
    source_url TEXT NOT NULL DEFAULT ''
);
CREATE TABLE assignments (
    model_sha256 TEXT NOT NULL,
    begin_block INTEGER NOT NULL,
    end_block INTEGER NOT NULL,
    peer_id TEXT NOT NULL,
    state INTEGER NOT NULL DEFAULT 0,    -- AssignmentStatus.State last reported (0: not yet)
    recipe_hash TEXT NOT NULL DEFAULT '',
    error TEXT NOT NULL DEFAULT '',
    updated_at_ms INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (model_sha256, begin_block, end_block, peer_id)
);
"""
    + _INTEGRITY_TABLES
    + _INVITE_TABLE
)

#: version -> statements that bring a file of that version to the next one
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "ALTER TABLE models ADD COLUMN path TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE nodes ADD COLUMN serving BLOB NOT NULL DEFAULT x''",
    ),
    2: ("ALTER TABLE models ADD COLUMN source_url TEXT NOT NULL DEFAULT ''",),
    3: tuple(statement for statement in _INTEGRITY_TABLES.split(";") if statement.strip()),
    4: tuple(statement for statement in _INVITE_TABLE.split(";") if statement.strip()),
}


class StoreError(Exception):
    """The database file cannot be used (wrong schema version, not a tracker database)."""


@dataclasses.dataclass(frozen=True)
class NodeRecord:
    peer_id: str
    public_key: bytes
    signed_fingerprint: swarm_pb2.SignedFingerprint
    fingerprint: swarm_pb2.Fingerprint
    admission: swarm_pb2.SignedAdmission
    admitted_at_ms: int
    expires_at_ms: int
    last_heartbeat_ms: int
    alive: bool
    listen_addrs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class AssignmentRow:
    assignment: Assignment
    state: int  # swarm_pb2.AssignmentStatus.State
    recipe_hash: str
    error: str
    updated_at_ms: int


def _parse(message_type, data: bytes):
    message = message_type()
    message.ParseFromString(data)
    return message


class TrackerStore(sqlite_db.SqliteStore):
    """Queries over one tracker database. Not thread-safe: use from one thread."""

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TrackerStore:
        """Open (creating if needed) the database at ``path``.

        Raises:
          StoreError: the file holds another schema version, is not a tracker database, or may be
            accessed by group or others (created 0600, as its WAL then is).
          sqlite3.Error / OSError: the file cannot be opened.
        """
        path = Path(path)
        try:
            connection = sqlite_db.connect(
                path, not_a_database=lambda error: StoreError(f"{path}: not a Baton tracker database ({error})")
            )
        except sqlite_db.DatabaseNotPrivate as error:
            raise StoreError(f"tracker {error}") from None
        return cls._adopt(connection, path)

    def _migrate(self) -> None:
        tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            with self._transaction() as db:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (STORE_SCHEMA_VERSION,))
            return
        if "schema_version" not in tables:
            raise StoreError(f"{self.path}: not a Baton tracker database (no schema_version table)")
        row = self._db.execute("SELECT version FROM schema_version").fetchone()
        version = None if row is None else row[0]
        if version == STORE_SCHEMA_VERSION:
            return
        if version not in _MIGRATIONS:
            raise StoreError(
                f"{self.path}: database schema version {version}, this tracker speaks {STORE_SCHEMA_VERSION}"
            )
        with self._transaction() as db:
            while version != STORE_SCHEMA_VERSION:
                for statement in _MIGRATIONS[version]:
                    db.execute(statement)
                version += 1
            db.execute("UPDATE schema_version SET version = ?", (version,))

    # --- models -----------------------------------------------------------------------------------

    def put_model(
        self,
        entry: swarm_pb2.ModelEntry,
        now_ms: int,
        path: str | os.PathLike[str] | None = None,
        source_url: str | None = None,
    ) -> None:
        """Register (or update) a model; its alias must not belong to another model. ``path``:
        the GGUF it was read from (stored absolute; ``None`` keeps the one already recorded).
        ``source_url``: where nodes fetch its bytes by range (``None`` keeps the recorded one,
        ``""`` clears it).

        Raises:
          StoreError: the alias is taken by a model with another sha256.
        """
        path_text = "" if path is None else str(Path(path).resolve())
        with self._transaction() as db:
            row = db.execute("SELECT sha256 FROM models WHERE alias = ?", (entry.alias,)).fetchone()
            if row is not None and row[0] != entry.sha256:
                raise StoreError(f"alias {entry.alias!r} already names model {row[0]}")
            db.execute(
                "INSERT INTO models (sha256, alias, name, entry, registered_at_ms, path) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (sha256) DO UPDATE SET "
                "alias = excluded.alias, name = excluded.name, entry = excluded.entry, "
                "path = CASE WHEN excluded.path != '' THEN excluded.path ELSE models.path END",
                (entry.sha256, entry.alias, entry.name, entry.SerializeToString(deterministic=True), now_ms, path_text),
            )
            if source_url is not None:
                db.execute("UPDATE models SET source_url = ? WHERE sha256 = ?", (source_url, entry.sha256))

    def model_source(self, sha256: str) -> str:
        """The source URL model ``sha256`` was registered with ("" for none or unknown)."""
        row = self._db.execute("SELECT source_url FROM models WHERE sha256 = ?", (sha256,)).fetchone()
        return row[0] if row is not None else ""

    def model_path(self, sha256: str) -> Path | None:
        """The file model ``sha256`` was registered from (None: unknown model, or registered
        by a tracker that did not record paths)."""
        row = self._db.execute("SELECT path FROM models WHERE sha256 = ?", (sha256,)).fetchone()
        return Path(row[0]) if row is not None and row[0] else None

    def models(self) -> list[swarm_pb2.ModelEntry]:
        rows = self._db.execute("SELECT entry FROM models ORDER BY alias, sha256").fetchall()
        return [_parse(swarm_pb2.ModelEntry, row[0]) for row in rows]

    def find_model(self, name: str) -> swarm_pb2.ModelEntry | None:
        """The model whose alias, sha256 or general.name is ``name`` (in that order)."""
        for column in ("alias", "sha256", "name"):
            row = self._db.execute(f"SELECT entry FROM models WHERE {column} = ? ORDER BY sha256", (name,)).fetchone()
            if row is not None:
                return _parse(swarm_pb2.ModelEntry, row[0])
        return None

    # --- nodes and clients ------------------------------------------------------------------------

    def put_node(self, node: NodeRecord) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO nodes (peer_id, public_key, signed_fingerprint, admission, admitted_at_ms, "
                "expires_at_ms, last_heartbeat_ms, alive, listen_addrs) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    node.peer_id,
                    node.public_key,
                    node.signed_fingerprint.SerializeToString(deterministic=True),
                    node.admission.SerializeToString(deterministic=True),
                    node.admitted_at_ms,
                    node.expires_at_ms,
                    node.last_heartbeat_ms,
                    int(node.alive),
                    json.dumps(list(node.listen_addrs)),
                ),
            )

    def node(self, peer_id: str) -> NodeRecord | None:
        row = self._db.execute(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE peer_id = ?", (peer_id,)).fetchone()
        return None if row is None else _node(row)

    def nodes(self) -> list[NodeRecord]:
        return [_node(row) for row in self._db.execute(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY peer_id")]

    def record_heartbeat(
        self,
        peer_id: str,
        now_ms: int,
        listen_addrs: Iterable[str] | None,
        serving: Iterable[swarm_pb2.AssignmentStatus] = (),
    ) -> None:
        """Mark the node alive and heard at ``now_ms``, reporting ``serving`` (and update its
        addresses if given)."""
        reported = swarm_pb2.NodeEntry(serving=serving).SerializeToString(deterministic=True)
        with self._transaction() as db:
            if listen_addrs is None:
                db.execute(
                    "UPDATE nodes SET last_heartbeat_ms = ?, alive = 1, serving = ? WHERE peer_id = ?",
                    (now_ms, reported, peer_id),
                )
            else:
                db.execute(
                    "UPDATE nodes SET last_heartbeat_ms = ?, alive = 1, listen_addrs = ?, serving = ? "
                    "WHERE peer_id = ?",
                    (now_ms, json.dumps(list(listen_addrs)), reported, peer_id),
                )

    def mark_dead(self, peer_ids: Iterable[str]) -> None:
        with self._transaction() as db:
            db.executemany("UPDATE nodes SET alive = 0 WHERE peer_id = ?", [(p,) for p in peer_ids])

    def update_admission(self, peer_id: str, admission: swarm_pb2.SignedAdmission, expires_at_ms: int) -> None:
        with self._transaction() as db:
            db.execute(
                "UPDATE nodes SET admission = ?, expires_at_ms = ? WHERE peer_id = ?",
                (admission.SerializeToString(deterministic=True), expires_at_ms, peer_id),
            )

    def put_client(
        self,
        peer_id: str,
        public_key: bytes,
        admission: swarm_pb2.SignedAdmission,
        admitted_at_ms: int,
        expires_at_ms: int,
    ) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO clients (peer_id, public_key, admission, admitted_at_ms, expires_at_ms) "
                "VALUES (?, ?, ?, ?, ?)",
                (peer_id, public_key, admission.SerializeToString(deterministic=True), admitted_at_ms, expires_at_ms),
            )

    def client_admission(self, peer_id: str) -> swarm_pb2.SignedAdmission | None:
        row = self._db.execute("SELECT admission FROM clients WHERE peer_id = ?", (peer_id,)).fetchone()
        return None if row is None else _parse(swarm_pb2.SignedAdmission, row[0])

    # --- invites ------------------------------------------------------------------------------------

    def add_invite(self, token_sha256: str, uses: int, expires_at_ms: int, note: str, now_ms: int) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT INTO invites (token_sha256, uses_left, expires_at_ms, note, created_at_ms) VALUES (?, ?, ?, ?, ?)",
                (token_sha256, uses, expires_at_ms, note, now_ms),
            )

    def invite(self, token_sha256: str) -> InviteRow | None:
        row = self._db.execute(
            "SELECT uses_left, expires_at_ms FROM invites WHERE token_sha256 = ?", (token_sha256,)
        ).fetchone()
        return None if row is None else InviteRow(uses_left=row[0], expires_at_ms=row[1])

    def use_invite(self, token_sha256: str) -> None:
        """One use of the invite taken (the caller checked it had one left)."""
        with self._transaction() as db:
            db.execute("UPDATE invites SET uses_left = uses_left - 1 WHERE token_sha256 = ?", (token_sha256,))

    def invites(self) -> list[tuple[str, int, int, str, int]]:
        """Every invite: ``(token_sha256, uses_left, expires_at_ms, note, created_at_ms)``, newest first."""
        return list(
            self._db.execute(
                "SELECT token_sha256, uses_left, expires_at_ms, note, created_at_ms FROM invites"
                " ORDER BY created_at_ms DESC, token_sha256"
            )
        )

    # --- nonces -------------------------------------------------------------------------------------

    def nonce_seen(self, peer_id: str, nonce: bytes) -> bool:
        row = self._db.execute(
            "SELECT 1 FROM seen_nonces WHERE peer_id = ? AND nonce = ?", (peer_id, bytes(nonce))
        ).fetchone()
        return row is not None

    def add_nonce(self, peer_id: str, nonce: bytes, now_ms: int) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO seen_nonces (peer_id, nonce, seen_at_ms) VALUES (?, ?, ?)",
                (peer_id, bytes(nonce), now_ms),
            )

    def prune_nonces(self, before_ms: int) -> int:
        """Forget nonces seen before ``before_ms`` (too old to pass the freshness check anyway)."""
        with self._transaction() as db:
            return db.execute("DELETE FROM seen_nonces WHERE seen_at_ms < ?", (before_ms,)).rowcount

    # --- assignments --------------------------------------------------------------------------------

    def assignments(self) -> list[AssignmentRow]:
        rows = self._db.execute(
            "SELECT model_sha256, begin_block, end_block, peer_id, state, recipe_hash, error, updated_at_ms "
            "FROM assignments ORDER BY model_sha256, begin_block, end_block, peer_id"
        ).fetchall()
        return [AssignmentRow(Assignment(r[0], r[1], r[2], r[3]), r[4], r[5], r[6], r[7]) for r in rows]

    def replace_assignments(self, assignments: Iterable[Assignment]) -> None:
        """Make the assignment set exactly ``assignments``; rows that stay keep their status."""
        wanted = set(assignments)
        with self._transaction() as db:
            existing = {
                Assignment(*row)
                for row in db.execute("SELECT model_sha256, begin_block, end_block, peer_id FROM assignments")
            }
            db.executemany(
                "DELETE FROM assignments WHERE model_sha256 = ? AND begin_block = ? AND end_block = ? AND peer_id = ?",
                [(a.model_sha256, a.begin, a.end, a.peer_id) for a in sorted(existing - wanted)],
            )
            db.executemany(
                "INSERT INTO assignments (model_sha256, begin_block, end_block, peer_id) VALUES (?, ?, ?, ?)",
                [(a.model_sha256, a.begin, a.end, a.peer_id) for a in sorted(wanted - existing)],
            )

    def set_status(self, assignment: Assignment, state: int, recipe_hash: str, error: str, now_ms: int) -> bool:
        """Record what the node reports for one of its assignments; False if it is not assigned."""
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE assignments SET state = ?, recipe_hash = ?, error = ?, updated_at_ms = ? "
                "WHERE model_sha256 = ? AND begin_block = ? AND end_block = ? AND peer_id = ?",
                (
                    state,
                    recipe_hash,
                    error,
                    now_ms,
                    assignment.model_sha256,
                    assignment.begin,
                    assignment.end,
                    assignment.peer_id,
                ),
            )
            return cursor.rowcount > 0

    def clear_status(self, peer_id: str) -> None:
        """Forget the states a node reported (it died: what it had loaded is gone)."""
        with self._transaction() as db:
            db.execute("UPDATE assignments SET state = 0, recipe_hash = '', error = '' WHERE peer_id = ?", (peer_id,))
            db.execute("UPDATE nodes SET serving = x'' WHERE peer_id = ?", (peer_id,))

    # --- output integrity --------------------------------------------------------------------------

    def add_integrity_failure(self, peer_id: str, failure: swarm_pb2.IntegrityFailure) -> int:
        """Record a check ``peer_id`` failed (its evidence); returns how many it has failed."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO integrity_failures (peer_id, at_ms, failure) VALUES (?, ?, ?)",
                (peer_id, failure.at_ms, failure.SerializeToString(deterministic=True)),
            )
        return len(self.integrity_failures(peer_id))

    def integrity_failures(self, peer_id: str, since_ms: int = 0) -> list[swarm_pb2.IntegrityFailure]:
        """The checks ``peer_id`` failed at or after ``since_ms``, oldest first."""
        rows = self._db.execute(
            "SELECT failure FROM integrity_failures WHERE peer_id = ? AND at_ms >= ? ORDER BY at_ms, rowid",
            (peer_id, since_ms),
        ).fetchall()
        return [_parse(swarm_pb2.IntegrityFailure, row[0]) for row in rows]

    def add_check_passed(self, peer_id: str) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT INTO node_integrity (peer_id, checks_passed) VALUES (?, 1) "
                "ON CONFLICT (peer_id) DO UPDATE SET checks_passed = checks_passed + 1",
                (peer_id,),
            )

    def refuse_node(self, peer_id: str, reason: str) -> None:
        """From now on the tracker refuses ``peer_id`` (``reason`` is what it is told)."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO node_integrity (peer_id, refused) VALUES (?, ?) "
                "ON CONFLICT (peer_id) DO UPDATE SET refused = excluded.refused",
                (peer_id, reason),
            )

    def refused(self, peer_id: str) -> str:
        """Why ``peer_id`` is refused ("" when it is not)."""
        row = self._db.execute("SELECT refused FROM node_integrity WHERE peer_id = ?", (peer_id,)).fetchone()
        return row[0] if row is not None else ""

    # --- views ----------------------------------------------------------------------------------------

    def node_entries(
        self, alive: Collection[str] | None = None, pending: Collection[str] = ()
    ) -> list[swarm_pb2.NodeEntry]:
        """Every node as a ``NodeEntry``, by peer id. ``alive`` / ``pending``: the peers the
        running service holds alive / pending; ``None`` (a reader of the file, e.g. the CLI)
        takes the stored flag, i.e. what the tracker last decided."""
        assigned: dict[str, list[Assignment]] = {}
        for row in self.assignments():
            assigned.setdefault(row.assignment.peer_id, []).append(row.assignment)
        reported = dict(self._db.execute("SELECT peer_id, serving FROM nodes").fetchall())
        integrity = {
            row[0]: row[1:] for row in self._db.execute("SELECT peer_id, checks_passed, refused FROM node_integrity")
        }
        entries = []
        for node in self.nodes():
            entry = _parse(swarm_pb2.NodeEntry, reported.get(node.peer_id) or b"")
            entry.peer_id = node.peer_id
            entry.listen_addrs.extend(node.listen_addrs)
            entry.alive = node.alive if alive is None else node.peer_id in alive
            entry.pending = node.peer_id in pending
            entry.last_heartbeat_ms = node.last_heartbeat_ms
            entry.usable_memory_bytes = node.fingerprint.usable_memory_bytes
            entry.assigned.extend(
                swarm_pb2.Assignment(model_sha256=a.model_sha256, begin=a.begin, end=a.end)
                for a in assigned.get(node.peer_id, ())
            )
            entry.integrity_failures.extend(self.integrity_failures(node.peer_id))
            entry.checks_passed, entry.refused = integrity.get(node.peer_id, (0, ""))
            entries.append(entry)
        return entries


_NODE_COLUMNS = (
    "peer_id, public_key, signed_fingerprint, admission, admitted_at_ms, expires_at_ms, last_heartbeat_ms, alive, "
    "listen_addrs"
)


def _node(row) -> NodeRecord:
    signed = _parse(swarm_pb2.SignedFingerprint, row[2])
    return NodeRecord(
        peer_id=row[0],
        public_key=bytes(row[1]),
        signed_fingerprint=signed,
        fingerprint=_parse(swarm_pb2.Fingerprint, signed.fingerprint),
        admission=_parse(swarm_pb2.SignedAdmission, row[3]),
        admitted_at_ms=row[4],
        expires_at_ms=row[5],
        last_heartbeat_ms=row[6],
        alive=bool(row[7]),
        listen_addrs=tuple(json.loads(row[8])),
    )


@contextlib.contextmanager
def open_store(path: str | os.PathLike[str]) -> Iterator[TrackerStore]:
    """``TrackerStore.open(path)``, closed on exit."""
    store = TrackerStore.open(path)
    try:
        yield store
    finally:
        store.close()
