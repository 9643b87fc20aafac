"""The native worker's command line as a config: ``WorkerConfig``, one field per flag that
``native/src/main.cpp`` accepts (tests/test_worker_flags.py checks the two are the same set).

``baton worker``'s options are derived from it, and so is every worker command line
(``agent.io.worker.process.worker_argv``). A tunable left None is not passed: the binary's
own default holds (main.cpp, printed by ``baton-worker --help``).

Must not import the worker's other modules (``process`` reads this one).
"""

from __future__ import annotations

import dataclasses

from agent import cli_args
from agent.io.settings import setting

__all__ = ["WorkerConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """One worker process's flags (``baton-worker --help`` says what each does)."""

    model: str = setting(help="GGUF file", required=True)
    layers: str | None = setting(
        None, "BEGIN:END (END empty or -1: to the end); required unless --vocab-only", parse=cli_args.layers
    )
    vocab_only: bool = setting(
        False, "load only the vocabulary (Info, Health, Tokenize, Detokenize, Vocabulary); no --layers"
    )
    socket: str = setting(help="Unix socket path to listen on", required=True)
    forward_socket: str | None = setting(
        None, "also serve Forward as a framed stream on this Unix socket (default: off)", metavar="PATH"
    )
    data_listen: str | None = setting(
        None,
        "serve the data plane (sealed steps from the hop before) on TCP HOST:PORT; port 0: any (default: off)",
        metavar="HOST:PORT",
    )
    prefill_pace_ms: int | None = setting(
        None,
        "while sessions decode on the data plane, a prompt chunk (a prefill Forward or a data-plane step of"
        " more than one row) waits up to this long for the next decode Forward (default 1000; 0: no pacing)",
        parse=cli_args.non_negative_int,
        metavar="MS",
    )
    data_unproven_timeout_ms: int | None = setting(
        None,
        "a data-plane connection that has sent no frame of a session bound here is closed after this long"
        " (default 30000)",
        parse=cli_args.positive_int,
        metavar="MS",
    )
    data_max_connections: int | None = setting(
        None,
        "the count of data-plane connections, accepted and dialled (default 256)",
        parse=cli_args.positive_int,
        metavar="N",
    )
    ctx_size: int | None = setting(
        None, "positions per sequence (default 2048)", parse=cli_args.positive_int, metavar="N"
    )
    max_sequences: int | None = setting(
        None, "sequences held at once (default 4)", parse=cli_args.positive_int, metavar="N"
    )
    batch_size: int | None = setting(
        None, "most rows in one Forward (default 512)", parse=cli_args.positive_int, metavar="N"
    )
    threads: int | None = setting(
        None, "CPU threads per Forward (default: all cores)", parse=cli_args.positive_int, metavar="N"
    )
    threads_decode: int | None = setting(
        None,
        "CPU threads of a Forward of one row, a lone session's decode step (default: --threads)",
        parse=cli_args.positive_int,
        metavar="N",
    )
    gpu_layers: int | None = setting(
        None, "blocks to offload to the GPU backend (default -1: all)", parse=int, metavar="N"
    )
    model_sha256: str | None = setting(None, "the model's sha256 hex (skips hashing the file)")
    mmap: bool = setting(True, "read the model instead of mapping it", flag="--no-mmap")
    top_k_in_graph: str | None = setting(
        None,
        "where the last range selects a Forward's top-K and log-sum-exp: on (in llama.cpp's graph), off (on the"
        " host from the full rows) or auto (in the graph when blocks are offloaded to a non-CPU backend; the default)",
        choices=("auto", "on", "off"),
    )
    prefix_cache_bytes: int | None = setting(
        None,
        "bytes of KV kept for ended sessions' prompt prefixes, reused by new sessions that start with them"
        " (least recently used out; default 0: off)",
        parse=cli_args.non_negative_int,
        metavar="N",
    )
    rollback_positions: int | None = setting(
        None,
        "positions of rollback snapshots kept per sequence, for models whose state cannot be cut back"
        " (DeepSeek V4) (default 0)",
        parse=cli_args.non_negative_int,
        metavar="N",
    )
