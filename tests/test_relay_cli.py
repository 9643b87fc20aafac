"""``baton relay keys`` and ``baton relay ledger`` as real processes (``python -m agent.cli``):
what they print, their exit codes, and that a key is printed once and never again."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.core.relay.quotas import day_of
from agent.io.relay.store import open_relay_store

pytestmark = pytest.mark.swarm

REPO_ROOT = Path(__file__).resolve().parent.parent
COMMAND_TIMEOUT_S = 60.0
KEY_PATTERN = re.compile(r"sk-baton-[A-Za-z0-9_-]{43}")


def baton_relay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "relay", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )


def _one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_keys_are_private_unless_made_or_marked_shareable(tmp_path: Path) -> None:
    db = str(tmp_path / "relay.db")
    public = baton_relay("keys", "add", "public", "--db", db, "--shareable-prefixes")
    assert public.returncode == 0 and "shareable prefixes" in public.stderr, public.stderr
    assert baton_relay("keys", "add", "alice", "--db", db).returncode == 0

    def marks() -> list[tuple[str, bool]]:
        keys = json.loads(baton_relay("keys", "list", "--db", db, "--json").stdout)
        return [(k["name"], k["shareable_prefixes"]) for k in keys]

    assert marks() == [("alice", False), ("public", True)]
    header, alice, _public = baton_relay("keys", "list", "--db", db).stdout.splitlines()
    assert "PREFIXES" in header.split() and alice.split()[-2:] == ["own", "live"]
    shared = baton_relay("keys", "share", "alice", "--db", db)
    assert shared.returncode == 0 and "shares its prompt prefixes" in shared.stdout, shared
    unshared = baton_relay("keys", "unshare", "public", "--db", db)
    assert unshared.returncode == 0 and "keeps its prompt prefixes" in unshared.stdout, unshared
    assert marks() == [("alice", True), ("public", False)]
    _one_line_error(baton_relay("keys", "share", "carol", "--db", db), "baton relay keys share:", "no live key")


def test_keys_add_list_revoke(tmp_path: Path) -> None:
    db = str(tmp_path / "state" / "relay.db")
    added = baton_relay(
        "keys", "add", "alice", "--db", db, "--tokens-per-day", "1000", "--requests-per-minute", "30",
        "--max-concurrent", "2",
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    (api_key,) = added.stdout.splitlines()  # the key, alone on its line, and nothing else
    assert KEY_PATTERN.fullmatch(api_key)
    assert "only this once" in added.stderr and "sha256" in added.stderr
    assert api_key not in added.stderr
    assert baton_relay("keys", "add", "bob", "--db", db).returncode == 0

    # Usage today: recorded for the day the test sees and the next one, so that a run across
    # midnight UTC still finds 42 tokens on whichever day the command sees.
    now_s = time.time()
    with open_relay_store(db) as store:
        assert store.authenticate(api_key).name == "alice"
        for day in {day_of(now_s), day_of(now_s + 86_400)}:
            store.add_usage("alice", day, 40, 2)

    duplicate = baton_relay("keys", "add", "alice", "--db", db)
    _one_line_error(duplicate, "baton relay keys add:", "'alice' already exists")

    listed = baton_relay("keys", "list", "--db", db)
    assert listed.returncode == 0, listed.stderr
    assert api_key not in listed.stdout and "sk-baton-" not in listed.stdout
    header, alice, bob = listed.stdout.splitlines()
    assert header.split()[:4] == ["NAME", "TOKENS/DAY", "REQUESTS/MIN", "CONCURRENT"]
    assert alice.split()[:5] == ["alice", "1000", "30", "2", "42"] and alice.split()[-1] == "live"
    assert bob.split()[:5] == ["bob", "unlimited", "unlimited", "unlimited", "0"]

    as_json = baton_relay("keys", "list", "--db", db, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert "sk-baton-" not in as_json.stdout
    keys = json.loads(as_json.stdout)
    assert [k["name"] for k in keys] == ["alice", "bob"]
    assert keys[0]["limits"] == {"tokens_per_day": 1000, "requests_per_minute": 30, "max_concurrent": 2}
    assert (keys[0]["prompt_tokens_today"], keys[0]["completion_tokens_today"], keys[0]["tokens_today"]) == (40, 2, 42)
    assert keys[1]["limits"] == {"tokens_per_day": None, "requests_per_minute": None, "max_concurrent": None}
    assert [k["revoked"] for k in keys] == [False, False]

    revoked = baton_relay("keys", "revoke", "alice", "--db", db)
    assert (revoked.returncode, revoked.stdout.strip()) == (0, "revoked key 'alice'")
    _one_line_error(baton_relay("keys", "revoke", "alice", "--db", db), "no live key named 'alice'")
    _one_line_error(baton_relay("keys", "revoke", "carol", "--db", db), "no live key named 'carol'")
    with open_relay_store(db) as store:
        assert store.authenticate(api_key).revoked

    keys = json.loads(baton_relay("keys", "list", "--db", db, "--json").stdout)
    assert [(k["name"], k["revoked"]) for k in keys] == [("alice", True), ("bob", False)]
    # The name is free again once its key is revoked.
    again = baton_relay("keys", "add", "alice", "--db", db)
    assert again.returncode == 0 and KEY_PATTERN.fullmatch(again.stdout.strip()) and again.stdout.strip() != api_key


def test_ledger(tmp_path: Path) -> None:
    db = tmp_path / "relay.db"
    with open_relay_store(db) as store:
        empty = baton_relay("ledger", "--db", str(db))
        store.credit("cmpl-1", "m" * 64, [("peerA", 0, 10, 12), ("peerB", 10, 30, 12)], 30, 1_700_000_000.0)
        store.credit("cmpl-2", "m" * 64, [("peerB", 0, 30, 3)], 30, 1_700_000_001.0)
    assert (empty.returncode, empty.stdout.split()) == (0, ["PEER", "ID", "ROWS", "CREDIT", "COMPLETIONS"])

    text = baton_relay("ledger", "--db", str(db))
    assert text.returncode == 0, text.stderr
    assert [line.split() for line in text.stdout.splitlines()[1:]] == [
        ["peerB", "15", "11.000", "2"],  # 12 * 20/30 + 3
        ["peerA", "12", "4.000", "1"],  # 12 * 10/30
    ]
    as_json = baton_relay("ledger", "--db", str(db), "--json")
    assert as_json.returncode == 0, as_json.stderr
    entries = json.loads(as_json.stdout)
    assert [(e["peer_id"], e["rows"], e["completions"]) for e in entries] == [("peerB", 15, 2), ("peerA", 12, 1)]
    assert [e["credit"] for e in entries] == pytest.approx([11.0, 4.0])


def test_missing_or_unusable_database_and_bad_arguments(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    for args in (["keys", "list"], ["keys", "revoke", "alice"], ["ledger"]):
        _one_line_error(baton_relay(*args, "--db", str(missing)), "no relay database at")
    assert not missing.exists()  # only ``keys add`` creates the database

    loose = tmp_path / "loose.db"
    with open_relay_store(loose):
        pass
    loose.chmod(0o644)
    _one_line_error(baton_relay("keys", "list", "--db", str(loose)), "must not be accessible by group or others")

    _one_line_error(baton_relay("keys", "add", "anonymous", "--db", str(tmp_path / "a.db")), "reserved")
    zero = baton_relay("keys", "add", "alice", "--db", str(tmp_path / "b.db"), "--tokens-per-day", "0")
    assert zero.returncode == 2 and "--tokens-per-day: must be >= 1" in zero.stderr
