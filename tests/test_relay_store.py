"""The relay's SQLite store (agent.io.relay.store) on real files: API keys kept only as hashes,
authenticate / revoke, usage and request times, the ledger (idempotent per completion), and
that everything survives closing and reopening the file, which is mode 0600."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.core.relay.quotas import KeyLimits, day_of
from agent.io.relay.store import (
    ANONYMOUS,
    API_KEY_PREFIX,
    RELAY_SCHEMA_VERSION,
    KeyExistsError,
    KeyRecord,
    LedgerEntry,
    StoreError,
    hash_api_key,
    open_relay_store,
)

pytestmark = pytest.mark.swarm

T0_S = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
DAY = day_of(T0_S)
MODEL = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
THREE_HOPS = [("n1", 0, 10, 12), ("n2", 10, 20, 12), ("n3", 20, 30, 12)]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "relay.db"


def _file_bytes(db_path: Path) -> bytes:
    """The database and whatever WAL / shared-memory files sit next to it."""
    return b"".join(p.read_bytes() for p in db_path.parent.glob(db_path.name + "*"))


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


# --- API keys -------------------------------------------------------------------------------


def test_keys_are_stored_only_as_hashes(db_path: Path) -> None:
    with open_relay_store(db_path) as store:
        api_key = store.create_key("alice", KeyLimits(tokens_per_day=1000), now_s=T0_S)
        assert api_key.startswith(API_KEY_PREFIX)
        assert len(api_key) == len(API_KEY_PREFIX) + 43  # token_urlsafe(32): 256 bits
        live_bytes = _file_bytes(db_path)  # the WAL holds the fresh commit
    closed_bytes = _file_bytes(db_path)
    digest = hashlib.sha256(api_key.encode()).hexdigest().encode()
    for data in (live_bytes, closed_bytes):
        assert api_key.encode() not in data
        assert api_key.removeprefix(API_KEY_PREFIX).encode() not in data
        assert digest in data  # what is stored instead (so these are the right bytes)


def test_every_key_is_new(db_path: Path) -> None:
    with open_relay_store(db_path) as store:
        keys = {store.create_key(f"user{i}", KeyLimits()) for i in range(20)}
    assert len(keys) == 20


def test_authenticate_known_unknown_and_revoked(db_path: Path) -> None:
    with open_relay_store(db_path) as store:
        limits = KeyLimits(tokens_per_day=1000, requests_per_minute=60, max_concurrent=2)
        api_key = store.create_key("alice", limits, now_s=T0_S)
        key_id = hash_api_key(api_key)
        assert store.authenticate(api_key) == KeyRecord("alice", limits, T0_S, revoked=False, key_sha256=key_id)
        assert store.authenticate(api_key + "x") is None
        assert store.authenticate("sk-baton-" + "A" * 43) is None
        assert store.authenticate("") is None
        assert store.authenticate("\udcff") is None  # a lone surrogate still hashes

        assert store.revoke_key("alice", now_s=T0_S + 1) is True
        assert store.authenticate(api_key) == KeyRecord("alice", limits, T0_S, revoked=True, key_sha256=key_id)
        assert store.revoke_key("alice") is False  # nothing live left to revoke
        assert store.revoke_key("nobody") is False


def test_one_live_key_per_name_and_reissue_after_revoke(db_path: Path) -> None:
    with open_relay_store(db_path) as store:
        first = store.create_key("alice", KeyLimits(tokens_per_day=10), now_s=T0_S)
        with pytest.raises(KeyExistsError, match="a key named 'alice' already exists"):
            store.create_key("alice", KeyLimits(), now_s=T0_S + 1)
        store.revoke_key("alice", now_s=T0_S + 2)
        second = store.create_key("alice", KeyLimits(tokens_per_day=20), now_s=T0_S + 3)
        assert store.authenticate(first).revoked
        record = store.authenticate(second)
        assert record is not None and not record.revoked and record.limits.tokens_per_day == 20
        store.create_key("bob", KeyLimits(max_concurrent=1), now_s=T0_S + 4)
        assert [(k.name, k.limits.tokens_per_day, k.revoked) for k in store.list_keys()] == [
            ("alice", 10, True),
            ("alice", 20, False),
            ("bob", None, False),
        ]


@pytest.mark.parametrize("name", ["", "a b", "-lead", "x" * 65, "naïve", "semi;colon", ANONYMOUS])
def test_bad_or_reserved_key_names(db_path: Path, name: str) -> None:
    with open_relay_store(db_path) as store:
        with pytest.raises(ValueError, match="key name"):
            store.create_key(name, KeyLimits())
        assert store.list_keys() == []


def test_a_key_is_private_unless_marked_shareable(db_path: Path) -> None:
    with open_relay_store(db_path) as store:
        private = store.create_key("alice", KeyLimits(), now_s=T0_S)
        public = store.create_key("bob", KeyLimits(), shareable_prefixes=True, now_s=T0_S)
        assert (store.authenticate(private).shareable_prefixes, store.authenticate(public).shareable_prefixes) == (
            False,
            True,
        )
        assert store.set_shareable_prefixes("alice", True) and store.authenticate(private).shareable_prefixes
        assert store.set_shareable_prefixes("bob", False) and not store.authenticate(public).shareable_prefixes
        assert not store.set_shareable_prefixes("nobody", True)
        store.revoke_key("alice")
        assert not store.set_shareable_prefixes("alice", False)  # only a live key is marked


def test_the_prefix_salt_secret_is_made_once_and_kept(db_path: Path) -> None:
    with open_relay_store(db_path) as store:
        secret = store.prefix_salt_secret
    assert len(secret) == 32
    with open_relay_store(db_path) as store:
        assert store.prefix_salt_secret == secret
    with open_relay_store(db_path.with_name("other.db")) as other:
        assert other.prefix_salt_secret != secret  # random per relay


# The relay database as schema version 1 made it (before keys could share prefixes).
_VERSION_1 = """
CREATE TABLE api_keys (key_sha256 TEXT PRIMARY KEY, name TEXT NOT NULL, tokens_per_day INTEGER,
    requests_per_minute INTEGER, max_concurrent INTEGER, created_at_s REAL NOT NULL, revoked_at_s REAL);
CREATE UNIQUE INDEX api_keys_live_name ON api_keys (name) WHERE revoked_at_s IS NULL;
CREATE TABLE usage (name TEXT NOT NULL, day TEXT NOT NULL, prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL, PRIMARY KEY (name, day));
CREATE TABLE requests (name TEXT NOT NULL, at_s REAL NOT NULL);
CREATE INDEX requests_by_name ON requests (name, at_s);
CREATE INDEX requests_by_time ON requests (at_s);
CREATE TABLE completions (completion_id TEXT PRIMARY KEY, model_sha256 TEXT NOT NULL, n_layer INTEGER NOT NULL,
    credited_at_s REAL NOT NULL);
CREATE TABLE credits (completion_id TEXT NOT NULL REFERENCES completions (completion_id), position INTEGER NOT NULL,
    peer_id TEXT NOT NULL, rows INTEGER NOT NULL, credit REAL NOT NULL, PRIMARY KEY (completion_id, peer_id));
CREATE INDEX credits_by_peer ON credits (peer_id);
PRAGMA application_id = 1114919532;  -- b"BtRl"
PRAGMA user_version = 1;
"""


def test_a_version_1_database_is_migrated_keeping_its_keys_usage_and_ledger(db_path: Path) -> None:
    api_key = API_KEY_PREFIX + "v1-key"
    connection = sqlite3.connect(db_path)
    connection.executescript(_VERSION_1)
    connection.execute(
        "INSERT INTO api_keys VALUES (?, 'alice', 100, NULL, NULL, ?, NULL)", (hash_api_key(api_key), T0_S)
    )
    connection.execute("INSERT INTO usage VALUES ('alice', ?, 3, 4)", (DAY,))
    connection.commit()
    connection.close()
    db_path.chmod(0o600)
    with open_relay_store(db_path) as store:
        record = store.authenticate(api_key)
        assert record == KeyRecord("alice", KeyLimits(tokens_per_day=100), T0_S, False, hash_api_key(api_key))
        assert not record.shareable_prefixes  # an existing key stays private
        assert store.tokens_on("alice", DAY) == 7
        secret = store.prefix_salt_secret
        assert len(secret) == 32
        assert store.credit("c1", MODEL, THREE_HOPS, 30, T0_S)
    with open_relay_store(db_path) as store:  # migrated once: the secret is kept
        assert store.prefix_salt_secret == secret
    connection = sqlite3.connect(db_path)
    assert connection.execute("PRAGMA user_version").fetchone()[0] == RELAY_SCHEMA_VERSION
    connection.close()


def test_keys_survive_reopening(db_path: Path) -> None:
    with open_relay_store(db_path) as store:
        api_key = store.create_key("alice", KeyLimits(requests_per_minute=5), now_s=T0_S)
        revoked_key = store.create_key("bob", KeyLimits(), now_s=T0_S)
        store.revoke_key("bob")
    with open_relay_store(db_path) as store:
        assert store.authenticate(api_key) == KeyRecord(
            "alice", KeyLimits(requests_per_minute=5), T0_S, False, hash_api_key(api_key)
        )
        assert store.authenticate(revoked_key).revoked


def test_a_second_process_sees_keys_created_while_the_first_has_the_file_open(db_path: Path) -> None:
    # ``baton relay keys add`` while ``baton relay serve`` holds the database.
    with open_relay_store(db_path) as server, open_relay_store(db_path) as cli:
        api_key = cli.create_key("late", KeyLimits())
        assert server.authenticate(api_key) is not None
        assert cli.revoke_key("late")
        assert server.authenticate(api_key).revoked


# --- usage ------------------------------------------------------------------------------------


def test_usage_accumulates_per_name_and_day_and_survives_reopening(db_path: Path) -> None:
    tomorrow = day_of(T0_S + 86_400)
    with open_relay_store(db_path) as store:
        store.create_key("alice", KeyLimits(tokens_per_day=1000))
        store.add_usage("alice", DAY, 100, 20)
        store.add_usage("alice", DAY, 5, 7)
        store.add_usage("alice", tomorrow, 1, 1)
        store.add_usage(ANONYMOUS, DAY, 3, 4)  # no key row needed
        assert store.tokens_on("alice", DAY) == 132
    with open_relay_store(db_path) as store:
        assert store.tokens_on("alice", DAY) == 132
        usage = store.usage_on("alice", DAY)
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (105, 27, 132)
        assert store.tokens_on("alice", tomorrow) == 2
        assert store.tokens_on(ANONYMOUS, DAY) == 7
        assert store.tokens_on("bob", DAY) == 0


@pytest.mark.parametrize(
    ("day", "prompt", "completion", "message"),
    [
        ("2023-11-14", -1, 0, "prompt_tokens must be an int >= 0"),
        ("2023-11-14", 0, 1.5, "completion_tokens must be an int >= 0"),
        ("14/11/2023", 0, 0, "day must be YYYY-MM-DD"),
    ],
)
def test_add_usage_refuses_bad_values(db_path: Path, day, prompt, completion, message) -> None:
    with open_relay_store(db_path) as store:
        with pytest.raises(ValueError, match=message):
            store.add_usage("alice", day, prompt, completion)


def test_request_times_within_the_minute_are_kept_and_older_ones_pruned(db_path: Path) -> None:
    with open_relay_store(db_path) as store:
        store.record_request("alice", T0_S)
        store.record_request("bob", T0_S + 1)
        store.record_request("alice", T0_S + 30)
        assert store.requests_since("alice", T0_S - 60) == [T0_S, T0_S + 30]
        assert store.requests_since("alice", T0_S) == [T0_S + 30]  # strictly after
        store.record_request("alice", T0_S + 61)  # T0_S and bob's T0_S + 1 are a minute old now
    with open_relay_store(db_path) as store:
        assert store.requests_since("alice", 0.0) == [T0_S + 30, T0_S + 61]
        assert store.requests_since("bob", 0.0) == []
        with contextlib.closing(sqlite3.connect(db_path)) as connection:
            assert connection.execute("SELECT count(*) FROM requests").fetchone()[0] == 2


# --- ledger -----------------------------------------------------------------------------------


def test_credit_is_idempotent_per_completion_and_durable(db_path: Path) -> None:
    with open_relay_store(db_path) as store:
        assert store.credit("cmpl-1", MODEL, THREE_HOPS, 30, T0_S) is True
        # A retry (even one that reports other hops) changes nothing.
        assert store.credit("cmpl-1", MODEL, THREE_HOPS, 30, T0_S + 1) is False
        assert store.credit("cmpl-1", MODEL, [("n9", 0, 30, 99)], 30, T0_S + 2) is False
        assert store.ledger_for("cmpl-1") == [
            LedgerEntry("n1", 12, 4.0, 1),
            LedgerEntry("n2", 12, 4.0, 1),
            LedgerEntry("n3", 12, 4.0, 1),
        ]
    with open_relay_store(db_path) as store:
        assert store.credit("cmpl-1", MODEL, THREE_HOPS, 30, T0_S + 3) is False
        assert [(e.peer_id, e.rows, e.credit, e.completions) for e in store.ledger()] == [
            ("n1", 12, 4.0, 1),
            ("n2", 12, 4.0, 1),
            ("n3", 12, 4.0, 1),
        ]


def test_ledger_sums_completions_most_credit_first(db_path: Path) -> None:
    with open_relay_store(db_path) as store:
        store.credit("cmpl-1", MODEL, THREE_HOPS, 30, T0_S)
        # n3 failed mid-way in the second completion; n4 took [20, 30) over.
        store.credit("cmpl-2", MODEL, [("n1", 0, 20, 6), ("n3", 20, 30, 2), ("n4", 20, 30, 4)], 30, T0_S + 10)
        store.credit("cmpl-3", "other-model", [("n4", 0, 18, 9)], 18, T0_S + 20)
    with open_relay_store(db_path) as store:
        ledger = store.ledger()
        assert [(e.peer_id, e.rows, e.completions) for e in ledger] == [
            ("n4", 13, 2),  # 4 * 10/30 + 9 * 18/18
            ("n1", 18, 2),  # 12 * 10/30 + 6 * 20/30
            ("n3", 14, 2),  # 12 * 10/30 + 2 * 10/30
            ("n2", 12, 1),  # 12 * 10/30
        ]
        assert [e.credit for e in ledger] == pytest.approx([9 + 4 / 3, 8.0, 4 + 2 / 3, 4.0])
        # One completion's entries in route order, not credit order.
        assert [e.peer_id for e in store.ledger_for("cmpl-2")] == ["n1", "n3", "n4"]
        assert store.ledger_for("cmpl-unknown") == []


def test_bad_hops_store_nothing(db_path: Path) -> None:
    with open_relay_store(db_path) as store:
        with pytest.raises(ValueError, match=r"range \[20, 31\) is not inside \[0, 30\)"):
            store.credit("cmpl-1", MODEL, [("n1", 0, 20, 5), ("n2", 20, 31, 5)], 30, T0_S)
        with pytest.raises(ValueError, match="completion_id must be a non-empty str"):
            store.credit("", MODEL, THREE_HOPS, 30, T0_S)
        assert store.ledger() == []
        # The completion was not marked as credited: a corrected call goes through.
        assert store.credit("cmpl-1", MODEL, THREE_HOPS, 30, T0_S) is True


# --- the file ---------------------------------------------------------------------------------


def test_database_file_is_owner_only_even_with_a_permissive_umask(tmp_path: Path) -> None:
    db_path = tmp_path / "new" / "dir" / "relay.db"
    with _umask(0), open_relay_store(db_path) as store:
        store.create_key("alice", KeyLimits())
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in db_path.parent.iterdir()}
        assert db_path.name + "-wal" in modes  # the WAL exists while the store is open
    assert set(modes.values()) == {0o600}, modes
    assert stat.S_IMODE(db_path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(db_path.stat().st_mode) == 0o600


def test_a_file_others_can_read_is_refused(db_path: Path) -> None:
    with open_relay_store(db_path):
        pass
    db_path.chmod(0o644)
    with pytest.raises(StoreError, match=r"has mode 0644; it must not be accessible by group or others"):
        with open_relay_store(db_path):
            pass


def test_schema_version_and_foreign_files(tmp_path: Path) -> None:
    db_path = tmp_path / "relay.db"
    with open_relay_store(db_path):
        pass
    connection = sqlite3.connect(db_path)
    assert connection.execute("PRAGMA user_version").fetchone()[0] == RELAY_SCHEMA_VERSION
    connection.execute(f"PRAGMA user_version = {RELAY_SCHEMA_VERSION + 1}")
    connection.close()
    with pytest.raises(
        StoreError, match=rf"schema version {RELAY_SCHEMA_VERSION + 1}, this relay speaks {RELAY_SCHEMA_VERSION}"
    ):
        with open_relay_store(db_path):
            pass

    other = tmp_path / "tracker.db"  # some other SQLite database, e.g. the tracker's
    connection = sqlite3.connect(other)
    connection.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    connection.commit()
    connection.close()
    other.chmod(0o600)
    with pytest.raises(StoreError, match="not a Baton relay database"):
        with open_relay_store(other):
            pass

    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not SQLite" * 100)
    garbage.chmod(0o600)
    with pytest.raises(StoreError, match="not a Baton relay database"):
        with open_relay_store(garbage):
            pass
