"""The relay's settings: ``RelayConfig``, the one place a tunable of ``baton relay serve`` is
named (unit, default, help). Its flags and its ``--config`` file's keys are derived from it
(``agent.io.settings``), and so is the harness's relay command line.

Must not import the relay's other modules (they all read it).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from agent import cli_args
from agent.core.owner.wire_choice import WIRE_CHOICES
from agent.io.settings import setting

__all__ = ["DEFAULT_LISTEN", "RelayConfig", "default_cache_dir", "listen_arg", "parse_listen"]

DEFAULT_LISTEN = "127.0.0.1:8000"


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` -> (host, port); port 0 asks for any free port.

    Raises:
      ValueError: no port, a port outside 0..65535, or an empty host.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"an IPv6 host goes in brackets, e.g. [::1]:8000, got {text!r}")
    port = int(port_text)
    if not host or port > 65535:
        raise ValueError(f"expected HOST:PORT with a port in 0..65535, got {text!r}")
    return host, port


def listen_arg(text: str) -> str:
    """``--listen``'s argparse type: ``HOST:PORT`` checked, returned as given."""
    try:
        parse_listen(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def default_cache_dir() -> Path:
    """``$BATON_CACHE/relay``, else ``~/.cache/baton/relay``."""
    from agent.models import cache_dir

    return cache_dir() / "relay"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RelayConfig:
    """A relay's settings. The fields made with ``setting`` are ``baton relay serve``'s flags
    (``--body-timeout-s`` for ``body_timeout_s``) and its ``--config`` file's keys.

    ``anonymous_tokens_per_day``: 0 switches anonymous access off (every request needs a key).
    ``max_choices``: a request whose ``n`` times its prompts is larger gets 400 naming ``n``.
    ``max_body_bytes``: larger request bodies get 413. ``body_timeout_s``: a body that has not
    all arrived this long after its headers gets 408 (a client trickling bytes holds nothing
    for long; Hypercorn's own read timeout would also cut long streamed answers).
    ``request_timeout_s``: one request to the tracker or a node.
    ``cache_dir``: None: ``$BATON_CACHE/relay`` (read when the relay starts).
    ``generation_timeout_s``: a whole generation over this gets 504.
    ``default_max_tokens``: a chat request without ``max_tokens`` generates at most this many
    (and never past the model's context).
    ``models_cache_s``: how long the tracker's model list is reused.
    ``preload_timeout_s``: how long start-up waits for the registered models' vocabularies.
    ``spot_check_rate``: the share of generations replayed through a second route and
    compared (``SwarmClientConfig.spot_check_rate``, docs/INTEGRITY.md).
    ``queue_retry_min_s`` / ``queue_retry_max_s``: how soon the first request of the waiting
    line tries again by itself after a busy try (doubling from min to max; once min, then max,
    after a try a freed sequence let go), for sequences freed by the swarm's other owners
    (``agent.core.relay.waiting_line``).
    ``wire``, ``link_mbit``: the dtype of the swarm sessions' boundary rows between hops, and
    the link estimate ``auto`` goes by (``SwarmClientConfig.wire``).
    ``prefill_chunk_tokens``, ``prefix_block_tokens``: the prompt's chunk and the prefix cache's
    block (``SwarmClientConfig``: a cached prefix ends on both).
    """

    # ``tracker`` and ``db`` have no default, and argparse does not require them: a
    # ``--config`` file may give them (``serve_main`` says when neither did).
    tracker: str = setting(help="the tracker's multiaddr, ending in /p2p/<peer id> (required)")
    db: Path = setting(help="the relay's SQLite database (created if missing; required)")
    listen: str = setting(
        DEFAULT_LISTEN,
        f"HTTP address (default {DEFAULT_LISTEN}; port 0: any free port, see --addr-file)",
        parse=listen_arg,
        metavar="HOST:PORT",
    )
    key: Path | None = setting(None, "the relay's Ed25519 peer key file (default: a new key each run)")
    anonymous_tokens_per_day: int = setting(
        0,
        "tokens per UTC day for requests without an API key, all together (default 0: anonymous access off)",
        parse=cli_args.non_negative_int,
        metavar="N",
    )
    max_body_bytes: int = setting(
        1 << 20, "largest request body (default 1048576)", parse=cli_args.positive_int, metavar="N"
    )
    max_choices: int = setting(
        8, "most choices one request may ask for: n times its prompts; each is a session (default 8)",
        parse=cli_args.positive_int, metavar="N",
    )  # fmt: skip
    body_timeout_s: float = setting(
        30.0,
        "seconds a request body may take to arrive after its headers, else 408 (default 30)",
        parse=cli_args.positive_float,
        metavar="S",
    )
    request_timeout_s: float = setting(
        10.0,
        "seconds one request to the tracker or a node may take (default 10)",
        parse=cli_args.positive_float,
        metavar="S",
    )
    step_timeout_s: float = setting(
        30.0,
        "seconds one generation step may take in the swarm (default 30)",
        parse=cli_args.positive_float,
        metavar="S",
    )
    queue_timeout_s: float = setting(
        60.0,
        "requests wait for a free sequence in one line, first come, first served; one is refused (503) only when"
        " no request of the line has started for this many seconds since it came (default 60)",
        parse=cli_args.positive_float,
        metavar="S",
    )
    cache_dir: Path | None = setting(
        None,
        "tokenizer and model metadata cache (default $BATON_CACHE/relay or ~/.cache/baton/relay)",
        metavar="DIR",
    )
    spot_check_rate: float = setting(
        0.01,
        "share of generations replayed through a second route and compared bit for bit (default 0.01)",
        parse=cli_args.probability,
        metavar="P",
    )
    addr_file: Path | None = setting(None, 'write "http://HOST:PORT" here once listening')
    p2p_listen: str = setting(
        "/ip4/127.0.0.1/tcp/0",
        "multiaddr of the relay's swarm side (default /ip4/127.0.0.1/tcp/0)",
        metavar="MADDR",
    )
    log_level: str = setting("INFO", "logging level on stderr (default INFO)")
    wire: str = setting(
        "f32", "boundary rows between hops: f32, f16, q8 or auto (by --link-mbit) (default f32)", choices=WIRE_CHOICES
    )
    link_mbit: float = setting(
        0.0,
        "the routes' slowest link in Mbit/s, for --wire auto (default 0: unknown, f32)",
        parse=cli_args.non_negative_float,
    )
    invite: str = setting(
        "",
        "an invite for the relay's key, where the tracker admits new keys only with one (default: none)",
        metavar="TOKEN",
    )
    prefill_chunk_tokens: int = setting(
        64,
        "prompt rows a step carries (default 64, the prefix cache's block: a cached prefix ends on a chunk)",
        parse=cli_args.positive_int,
    )
    prefix_block_tokens: int = setting(
        64, "tokens per prefix-cache block the sessions name to hops (default 64; 0: none)",
        parse=cli_args.non_negative_int,
    )  # fmt: skip
    speculate_tokens: int = setting(
        0,
        "speculative decoding: greedy chats draft up to N tokens from their own context, verified in one"
        " trip around the route, where the measured acceptance and trip times say it pays (default 8; 0: off)",
        parse=cli_args.non_negative_int,
        metavar="N",
        command_default=8,
    )
    # Limits no flag sets.
    generation_timeout_s: float = 600.0
    default_max_tokens: int = 1024
    models_cache_s: float = 2.0
    preload_timeout_s: float = 60.0
    queue_retry_min_s: float = 0.05
    queue_retry_max_s: float = 1.0

    @property
    def listen_host(self) -> str:
        return parse_listen(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return parse_listen(self.listen)[1]
