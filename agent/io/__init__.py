"""Thin trio shells around ``agent.core``: the only place that does I/O.

- ``worker_client``: gRPC client of one native shard worker (sync, plus a trio wrapper
  that runs the sync calls in threads; grpcio's asyncio API is never used under trio).
- ``worker_process``: start / stop the native worker binary (``open_worker``).
- ``parity_run``: drive an unsplit worker and a chain of range workers side by side.
"""
