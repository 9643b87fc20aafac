"""The tracker's settings (``TrackerConfig``: ``baton tracker serve``'s flags and the service's
limits, one place) and its clock (``trio_unix_clock``).

Must not import the tracker's service, store or verifier: they import this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import trio

from agent import cli_args
from agent.core.node.worker_wait import AUTO, WAIT_CHOICES
from agent.core.tracker.canary import CanaryPolicy
from agent.core.wire.address_rate import parse_networks
from agent.core.wire.admission_work import MAX_WORK_BITS
from agent.io.settings import setting

__all__ = ["TrackerConfig", "parse_host_port", "parse_model_arg", "trio_unix_clock"]


def _model_text(text: str) -> str:
    """``--register-model PATH[:ALIAS]``: checked (the file exists), returned as given."""
    path, _ = parse_model_arg(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{path} is not a file")
    return text


def _hf_repo_text(text: str) -> str:
    alias, sep, repo = text.partition("=")
    if not sep or not alias or repo.count("/") != 1 or repo.startswith("/") or repo.endswith("/"):
        raise argparse.ArgumentTypeError(f"expected ALIAS=ORG/NAME, got {text!r}")
    return text


def _source_text(text: str) -> str:
    alias, sep, url = text.partition("=")
    if not sep or not alias or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected ALIAS=http(s)://..., got {text!r}")
    return text


def parse_host_port(text: str) -> tuple[str, int]:
    """``[HOST:]PORT`` -> (host, port); HOST defaults to 127.0.0.1.

    Raises:
      argparse.ArgumentTypeError: no port, or one over 65535.
    """
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    if not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected [HOST:]PORT, got {text!r}")
    return (host.strip("[]") or "127.0.0.1"), int(port)


def _host_port_text(text: str) -> str:
    parse_host_port(text)
    return text


def parse_model_arg(text: str) -> tuple[Path, str]:
    """``PATH[:ALIAS]`` -> (path, alias); the alias defaults to the file name without .gguf.
    A colon followed by something with a ``/`` is part of the path."""
    path_text, sep, alias = text.rpartition(":")
    if not sep or not alias or "/" in alias or not path_text:
        path_text, alias = text, ""
    path = Path(path_text)
    if not alias:
        alias = path.name.removesuffix(".gguf")
    return path, alias


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackerConfig:
    """Tracker settings. The fields made with ``setting`` are ``baton tracker serve``'s flags
    (``agent.io.settings``); the rest the command resolves from them (``llama_cpp_commit`` /
    ``patch_series_sha256``: what nodes must run, ``--expected-pin`` or
    ``agent.runtime.expected_pin()``; ``canary``: from the ``canary_*`` settings) or no flag sets."""

    # (the command requires these two; "" where a tracker runs in-process, as in tests)
    db: str = setting("", "SQLite database (created if missing)", required=True)
    key_file: str = setting(
        "", "Ed25519 key file (created if missing; fixes the peer id)", flag="--key", metavar="KEY", required=True
    )
    listen: str = setting("/ip4/127.0.0.1/tcp/0", "multiaddr (default /ip4/127.0.0.1/tcp/0)")
    addr_file: str | None = setting(None, "write the full multiaddr (with /p2p/<id>) here once listening")
    relay: bool = setting(
        True,
        "do not act as a circuit relay for nodes that cannot be dialled (default: relay for admitted nodes)",
        flag="--no-relay",
    )
    register_model: tuple[str, ...] = setting(
        (), "register a GGUF model (repeatable)", parse=_model_text, metavar="PATH[:ALIAS]"
    )
    hf_repo: tuple[str, ...] = setting(
        (),
        "the Hugging Face repo of a registered model (default: what its GGUF metadata names)",
        parse=_hf_repo_text,
        metavar="ALIAS=ORG/NAME",
    )
    model_source: tuple[str, ...] = setting(
        (),
        "an HTTP(S) URL serving a registered model's file with range requests (a mirror)",
        parse=_source_text,
        metavar="ALIAS=URL",
    )
    serve_models: str | None = setting(
        None,
        "serve the registered model files over HTTP for nodes to fetch by range (HOST default 127.0.0.1)",
        parse=_host_port_text,
        metavar="[HOST:]PORT",
    )
    models_base_url: str | None = setting(None, "the base URL nodes reach --serve-models at", metavar="URL")
    heartbeat_interval_ms: int = setting(
        1000, "how often nodes send heartbeats, in ms (default 1000)", parse=cli_args.positive_int, metavar="MS"
    )
    heartbeat_timeout_ms: int = setting(
        5000,
        "a node not heard for this many ms is dead and loses its ranges (default 5000)",
        parse=cli_args.positive_int,
        metavar="MS",
    )
    loading_deadline_base_s: float = setting(
        120.0,
        "a range assigned to a node must be READY within this many seconds plus its bytes at"
        " --loading-min-bytes-per-s, or it is taken back (a node that says LOADING for ever holds nothing; default"
        " 120; 0: no deadline)",
        parse=cli_args.non_negative_float,
        metavar="S",
    )
    loading_min_bytes_per_s: int = setting(
        1_000_000,
        "the slowest download a node is allowed for a range's bytes (default 1000000: 8 Mbit/s)",
        parse=cli_args.positive_int,
        metavar="N",
    )
    new_identities_per_address_per_hour: int = setting(
        30,
        "the most new identities (node or client keys) the tracker admits from one IP address in an hour"
        " (default 30; 0: no limit): a self-made key costs an attacker an address, not nothing",
        parse=cli_args.non_negative_int,
        metavar="N",
    )
    admission_work_bits: int = setting(
        0,
        "a new identity (node or client key) must bring a proof of work of this many zero bits"
        " (default 0: none; each bit doubles it: 20 is about 0.7 s of a core, 24 about 11 s; at most 32)",
        parse=cli_args.non_negative_int,
        metavar="N",
    )
    require_invites: bool = setting(
        False,
        "admit a new identity (node or client key) only with an invite made by 'baton tracker invite'"
        " (keys admitted before need none)",
    )
    admission_rate_exempt: tuple[str, ...] = setting(
        (),
        "a network (CIDR) whose addresses --new-identities-per-address-per-hour does not limit (repeatable;"
        " loopback, the operator's own machine, is never limited unless --limit-loopback-admissions)",
        metavar="CIDR",
    )
    limit_loopback_admissions: bool = setting(
        False, "limit new identities from loopback addresses too (tests of the limit)"
    )
    route_requests_per_peer_per_s: int = setting(
        50,
        "the most route requests the tracker answers one peer in a second (default 50; 0: no limit): a"
        " route is a planning pass over every ready range, and a peer asking in a loop would take the tracker's core",
        parse=cli_args.non_negative_int,
        metavar="N",
    )
    admission_ttl_ms: int = setting(
        600_000,
        "how long a signed admission stays valid, in ms; nodes and clients renew it (default 600000: 10 min)",
        parse=cli_args.positive_int,
        metavar="MS",
    )
    registration_max_age_ms: int = setting(
        60_000, "fingerprint / hello timestamps must be this fresh (default 60000)", parse=cli_args.positive_int
    )
    expected_pin: str | None = setting(None, "llama.cpp commit nodes must run (default: this checkout's)")
    expected_patch_hash: str | None = setting(None, "patch series sha256 nodes must have (default: this checkout's)")
    canary_interval_s: float = setting(
        300.0,
        "mean seconds between two canary checks of one served range (default 300; 0: no checks)",
        parse=cli_args.non_negative_float,
        metavar="S",
    )
    canary_max_prompt_rows: int = setting(
        32, "a canary's prompt has 1..N rows (default 32)", parse=cli_args.positive_int, metavar="N"
    )
    canary_max_decode_steps: int = setting(
        4, "a canary has 1..N decode steps after its prompt (default 4)", parse=cli_args.non_negative_int, metavar="N"
    )
    canary_refuse_after: int = setting(
        2,
        "refuse a node once its output failed N checks (default 2; fewer withdraw the range)",
        parse=cli_args.positive_int,
        metavar="N",
    )
    canary_cross_recipe_rel_error: float = setting(
        0.02,
        "for a node of another recipe (backend): the relative RMS error allowed (default 0.02)",
        parse=cli_args.non_negative_float,
        metavar="X",
    )
    canary_threads: int = setting(
        1, "CPU threads per reference worker (default 1)", parse=cli_args.positive_int, metavar="N"
    )
    canary_worker_wait: str = setting(
        AUTO,
        "how a reference worker's idle threads wait for work, as a node's --worker-wait: spin, sleep (a"
        " microseconds' spin, then sleep) or auto (the default: sleep when a Baton node or worker already runs on this"
        " host, else spin; OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment are kept)",
        choices=WAIT_CHOICES,
    )
    canary_gate: bool = setting(
        True,
        "route a newly READY range before it passed its first check (default: only after)",
        flag="--no-canary-gate",
    )
    prefix_discount_per_token: float = setting(
        0.001,
        "routes: each prompt token a route's hops all hold in their prefix caches takes this share off the route's"
        " estimated step time when routes are compared (default 0.001: 320 tokens take 0.32 of it; 0: no preference)",
        parse=cli_args.non_negative_float,
        metavar="X",
    )
    prefix_discount_max: float = setting(
        0.5,
        "routes: the most share a cached prefix takes off a route's estimated step time (default 0.5: a route"
        " holding a long prefix still wins over one up to 2x faster, never over one faster still)",
        parse=cli_args.non_negative_float,
        metavar="X",
    )
    log_level: str = setting("INFO", "logging level on stderr (default INFO)")
    # Resolved by the command from the settings above, or set by no flag.
    llama_cpp_commit: str = ""
    patch_series_sha256: str = ""
    #: nonces are kept this long; must exceed registration_max_age_ms (older ones are stale anyway)
    nonce_retention_ms: int = 600_000
    #: estimated link latency per hop, for route planning
    hop_latency_s: float = 0.002
    #: how long a lost-peer probe waits for the peer to answer
    lost_peer_probe_timeout_s: float = 1.0
    #: a route handed out counts as a session on its hops until a heartbeat from the hop sent
    #: this long after it (by then the session shows in the node's own count, or never came)
    route_handout_grace_s: float = 2.0
    #: sessions one route's ranges take before routes go elsewhere (0: each worker's sequences)
    route_session_cap: int = 0
    #: read every registered file's metadata and hash its tensors when the tracker starts,
    #: so the first node to ask for a manifest does not wait (else: on the first request)
    prepare_manifests_at_start: bool = True
    #: canary checks of what nodes compute (``agent.core.tracker.canary``; run by
    #: ``agent.io.tracker.verifier``); None: no checks, every READY range is routed
    canary: CanaryPolicy | None = None
    #: an owner asking about a peer (``integrity``) hears of its failed checks this recent
    integrity_memory_ms: int = 3_600_000

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_ms", "heartbeat_timeout_ms", "admission_ttl_ms", "registration_max_age_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_timeout_ms <= self.heartbeat_interval_ms:
            raise ValueError(
                f"heartbeat_timeout_ms ({self.heartbeat_timeout_ms}) must exceed heartbeat_interval_ms "
                f"({self.heartbeat_interval_ms})"
            )
        if self.nonce_retention_ms <= self.registration_max_age_ms:
            raise ValueError("nonce_retention_ms must exceed registration_max_age_ms (or replays become possible)")
        parse_networks(self.admission_rate_exempt)  # (raises naming a bad one)
        if self.admission_work_bits > MAX_WORK_BITS:
            raise ValueError(f"admission_work_bits must be at most {MAX_WORK_BITS}, got {self.admission_work_bits}")


def trio_unix_clock() -> Callable[[], int]:
    """Unix time in ms that advances with ``trio.current_time()`` (so that a MockClock drives
    it), anchored to the wall clock when made. Call inside ``trio.run``."""
    wall_ms = time.time() * 1000.0
    start = trio.current_time()
    return lambda: round(wall_ms + (trio.current_time() - start) * 1000.0)
