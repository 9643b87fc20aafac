"""Thin trio shells around ``agent.core``: the only place that does I/O.

- ``net/``: peer transports (libp2p, the direct TLS channel, the circuit relay, hole punching)
  and the data-plane link to a worker.
- ``worker/``: one native shard worker: its process, gRPC client, errors and streams, and
  vocab-only workers for owners.
- ``keys``: owner-only key files; ``sqlite_db``: durable state; ``model_http``: model files
  over HTTP; ``gguf_sparse``: GGUF metadata prefixes.
- ``lifeline``: nothing Baton starts outlives its parent (a pipe for Baton's own commands,
  PR_SET_PDEATHSIG for other programs); ``stop_signals``: SIGTERM stops a command as Ctrl-C.

One package per role: ``tracker/``, ``node/``, ``client/`` (the session owner), ``relay/``,
``lab/``. Demos live in ``agent.demo`` and the process harness for tests and benchmarks in
``agent.harness``.
"""
