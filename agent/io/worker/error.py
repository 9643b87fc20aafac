"""The error a failed call to the native shard worker raises: ``WorkerError``.

Owns the one exception of the worker's clients (``agent.io.worker.client``'s gRPC calls and
``agent.io.worker.stream``'s Forward stream), named by gRPC status. Must not import either
client, gRPC or trio: anything that catches a worker's failure can import this alone.
"""

from __future__ import annotations

__all__ = ["WorkerError"]


class WorkerError(Exception):
    """A worker call failed: ``code_name`` is the gRPC status name (``"INVALID_ARGUMENT"``,
    ``"UNAVAILABLE"``, ``"DEADLINE_EXCEEDED"``, ...) and ``message`` the worker's details."""

    def __init__(self, code_name: str, message: str, *, method: str = "") -> None:
        super().__init__(code_name, message)
        self.code_name = code_name
        self.message = message
        self.method = method

    def __str__(self) -> str:
        where = f"{self.method}: " if self.method else ""
        return f"{where}{self.code_name}: {self.message}"
