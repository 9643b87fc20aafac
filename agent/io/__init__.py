"""Thin trio shells around ``agent.core``: the only place that does I/O.

- ``worker_client``: gRPC client of one native shard worker (sync, plus a trio wrapper
  that runs the sync calls in threads; grpcio's asyncio API is never used under trio).
- ``worker_process``: start / stop the native worker binary (``open_worker``).
- ``transport`` / ``p2p``: the peer transport interface and its libp2p implementation;
- ``keys``: owner-only key files.
- ``lifeline``: nothing Baton starts outlives its parent (a pipe for Baton's own commands,
  PR_SET_PDEATHSIG for other programs); ``stop_signals``: SIGTERM stops a command as Ctrl-C.

One package per role: ``tracker/``, ``node/``, ``client/``, ``relay/``. Demos live in
``agent.demo`` and the process harness for tests and benchmarks in ``agent.harness``.
"""
