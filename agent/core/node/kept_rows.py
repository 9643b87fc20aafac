"""The boundary rows a hop sent downstream, kept per session so that a lost next hop can be
rebuilt from them (resume, docs/ARCHITECTURE.md "When something goes wrong").

Owns, for one served range of one node:
- what is kept: each step's output rows as the bytes that went on the wire (dtype and schema
  as sent), in position order, per session; a step's rows are kept even when their push
  failed (the cache upstream holds them either way; a resume trims what the route lost);
- the budget: at most ``max_bytes_per_session`` per session. A session whose rows would go
  over it keeps none from then on (``lost``): it can no longer be resumed from here, and its
  owner falls back to re-prefilling a new route;
- trimming (a resume keeps positions ``[0, keep)``) and forgetting (the session ended);
- the replay: the kept rows of positions ``[0, n)`` in the shapes that rebuild the next
  range's cache *bit for bit*: every step of more than ``merge_rows`` rows (a prefill chunk)
  alone and whole, as it was first computed, and runs of smaller steps (decode rows) joined
  into chunks of at most ``merge_rows``. Why: on the pinned CPU build a batch of under ~60 rows
  computes each row exactly as a batch of one does, while larger batches take another path
  (measured: logits differ by ~0.5 between a 64-row batch and the same rows one by one, and
  are identical between 150 + 150 rows and 300 at once), so joining decode rows into a prefill-
  sized batch would change the numbers, and replaying each decode row alone would be slow.

Pure: bytes in, bytes out; no clock, no I/O. Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import dataclasses

from agent.core.wire.step_requests import ReplayChunk

__all__ = ["KeptRows", "KeptStore", "ReplayChunk", "RowsNotKept"]


class RowsNotKept(Exception):
    """The rows asked for are not (or no longer) kept; the message says which and why."""


@dataclasses.dataclass
class KeptRows:
    """One session's kept rows: ``steps`` in position order, ``n_bytes`` in all."""

    steps: list[ReplayChunk] = dataclasses.field(default_factory=list)
    n_bytes: int = 0
    lost: str = ""  # why this session's rows are no longer kept ("" while they are)

    @property
    def next_position(self) -> int:
        return self.steps[-1].first_position + self.steps[-1].n_rows if self.steps else 0


class KeptStore:
    """Kept rows of every session of one range.

    Args:
      max_bytes_per_session: the most bytes one session may keep (0: keep nothing).
    """

    def __init__(self, max_bytes_per_session: int) -> None:
        if max_bytes_per_session < 0:
            raise ValueError(f"max_bytes_per_session must be >= 0, got {max_bytes_per_session}")
        self.max_bytes_per_session = max_bytes_per_session
        self._sessions: dict[bytes, KeptRows] = {}

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    @property
    def n_bytes(self) -> int:
        return sum(kept.n_bytes for kept in self._sessions.values())

    def room(self, session_id: bytes) -> int:
        """Bytes the session may still keep (0 once its rows are lost)."""
        kept = self._sessions.get(session_id)
        if kept is None:
            return self.max_bytes_per_session
        return 0 if kept.lost else max(0, self.max_bytes_per_session - kept.n_bytes)

    def keep(
        self,
        session_id: bytes,
        first_position: int,
        n_rows: int,
        data: bytes,
        *,
        dtype: int,
        schema_version: int,
        streams: int,
    ) -> None:
        """Keep one step's output rows. Rows that do not continue the kept ones (a gap, an
        overlap) or would go over the budget make the session's rows lost."""
        kept = self._sessions.setdefault(session_id, KeptRows())
        if kept.lost:
            return
        if first_position != kept.next_position:
            self._lose(
                kept, f"rows at position {first_position} do not follow the kept ones (up to {kept.next_position})"
            )
            return
        if kept.n_bytes + len(data) > self.max_bytes_per_session:
            self._lose(
                kept,
                f"positions up to {first_position + n_rows} would take {kept.n_bytes + len(data)} bytes,"
                f" over the budget of {self.max_bytes_per_session} bytes per session",
            )
            return
        if kept.steps:
            last = kept.steps[-1]
            if (last.dtype, last.schema_version, last.streams) != (dtype, schema_version, streams):
                self._lose(kept, "the rows' dtype or schema changed within the session")
                return
        kept.steps.append(ReplayChunk(first_position, n_rows, bytes(data), dtype, schema_version, streams))
        kept.n_bytes += len(data)

    @staticmethod
    def _lose(kept: KeptRows, why: str) -> None:
        kept.steps.clear()
        kept.n_bytes = 0
        kept.lost = why

    def trim(self, session_id: bytes, keep_positions: int) -> None:
        """Keep rows of positions ``[0, keep_positions)`` only (a step's rows are cut within it)."""
        kept = self._sessions.get(session_id)
        if kept is None or kept.lost:
            return
        steps: list[ReplayChunk] = []
        n_bytes = 0
        for chunk in kept.steps:
            if chunk.first_position >= keep_positions:
                break
            if chunk.first_position + chunk.n_rows > keep_positions:
                n_rows = keep_positions - chunk.first_position
                row_bytes = len(chunk.data) // chunk.n_rows
                chunk = dataclasses.replace(chunk, n_rows=n_rows, data=chunk.data[: n_rows * row_bytes])
            steps.append(chunk)
            n_bytes += len(chunk.data)
        kept.steps, kept.n_bytes = steps, n_bytes

    def forget(self, session_id: bytes) -> None:
        self._sessions.pop(session_id, None)

    def replay(self, session_id: bytes, n_positions: int, max_rows: int, merge_rows: int = 16) -> list[ReplayChunk]:
        """The kept rows of positions ``[0, n_positions)``: each kept step of more than
        ``merge_rows`` rows as it was (cut at ``n_positions``), runs of smaller ones joined
        into chunks of at most ``merge_rows``; no chunk over ``max_rows`` (a longer step is
        cut, which only a receiver with a smaller batch than the sender's needs).

        Raises:
          RowsNotKept: the session keeps no rows here, they were lost (over the budget), or
            they do not reach ``n_positions``.
          ValueError: ``n_positions`` or ``max_rows`` < 1.
        """
        if n_positions < 1 or max_rows < 1 or merge_rows < 1:
            raise ValueError(
                f"n_positions ({n_positions}), max_rows ({max_rows}) and merge_rows ({merge_rows}) must be >= 1"
            )
        merge_rows = min(merge_rows, max_rows)
        kept = self._sessions.get(session_id)
        if kept is None:
            raise RowsNotKept(f"no rows are kept for session {session_id.hex()}")
        if kept.lost:
            raise RowsNotKept(f"the rows of session {session_id.hex()} are no longer kept: {kept.lost}")
        if kept.next_position < n_positions:
            raise RowsNotKept(
                f"session {session_id.hex()}: rows up to position {kept.next_position} are kept, {n_positions} asked"
            )
        chunks: list[ReplayChunk] = []
        parts: list[bytes] = []
        start = rows = 0
        first = kept.steps[0]
        row_bytes = len(first.data) // first.n_rows

        def flush() -> None:
            nonlocal parts, rows
            if rows:
                data = b"".join(parts)
                chunks.append(ReplayChunk(start, rows, data, first.dtype, first.schema_version, first.streams))
            parts, rows = [], 0

        for chunk in kept.steps:
            at = chunk.first_position
            end = min(at + chunk.n_rows, n_positions)
            # a big step goes alone (in pieces of max_rows); small ones join up to merge_rows
            limit = max_rows if chunk.n_rows > merge_rows else merge_rows
            if chunk.n_rows > merge_rows or rows + (end - at) > merge_rows:
                flush()
            while at < end:
                if rows == limit:
                    flush()
                if not rows:
                    start = at
                take = min(end - at, limit - rows)
                offset = (at - chunk.first_position) * row_bytes
                parts.append(chunk.data[offset : offset + take * row_bytes])
                rows += take
                at += take
            if chunk.n_rows > merge_rows:
                flush()
            if end == n_positions:
                break
        flush()
        return chunks
