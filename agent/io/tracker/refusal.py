"""``Refusal``: a tracker request is refused; its code (``swarm_pb2.Error.Code``) and message
become the ``TrackerReply``'s error (``Tracker.handle``).

Must not import the rest of the tracker: every part of it may raise this.
"""

from __future__ import annotations

__all__ = ["Refusal"]


class Refusal(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
