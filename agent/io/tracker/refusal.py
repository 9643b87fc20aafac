"""``Refusal``: a tracker request is refused; its code (``swarm_pb2.Error.Code``) and message
become the ``TrackerReply``'s error (``Tracker.handle``).

Must not import the rest of the tracker: every part of it may raise this.
"""

from __future__ import annotations

__all__ = ["Refusal"]


class Refusal(Exception):
    """``work_bits``: refused for want of a proof of work of this many bits (``Error.work_bits``)."""

    def __init__(self, code: int, message: str, *, work_bits: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.work_bits = work_bits
