"""The sessions one served range holds: session id -> worker sequence id, and what the next
step of each session must look like.

Owns, for one range of one node:
- allocating a worker sequence id at step 0 (refused with RESOURCE_EXHAUSTED when all are
  taken) and binding the session to its owner (a step of someone else's session is refused);
- the step order: step N + 1 after step N, positions continuing where the last accepted step
  ended, within the worker's context per sequence. Accepting a step reserves its positions at
  once, so a step that arrives while the previous one is still queued is checked correctly;
- resuming after a hop elsewhere on the route was lost: a surviving session goes back to a
  position it held (``resume``: the shell trims the worker's cache to it) and expects the
  owner's next step number; a replacement range opens a session from *rebuild* steps
  (``accept_rebuild``: rows from position 0, replayed by the hop before it) that then
  continues at the same step number;
- leases: a session is freed when its owner neither steps nor touches it for the idle timeout
  (``idle``), and also when it has not *stepped* for the stall bound however often it is
  touched (``stalled``): a touch only bridges a wait (a prompt chunk upstream, a rebuild), so
  an owner that opens sessions and then only touches them cannot hold sequences for ever. A
  session bound on the data plane steps on the worker: the shell reports what the worker
  says (``note_bound_progress``) before the stall rule frees it;
- per address: sessions opened from one source address (a client's, at a first hop) count
  against the same share as one owner's, so that many self-made keys behind one address get
  no more than one would;
- a reserve: ``reserve_for_trusted`` sequences are kept for owners the node trusts (its relay):
  other owners together never hold more than the rest, so self-made keys cannot lock a range
  out for the trusted ones; a trusted owner is held to no per-owner share (it may take every
  free sequence: one relay serves many users);
- ending sessions (end_session, idle timeout, failures): an ended session's sequence id is
  *closing* until the shell has removed the sequence on the worker (between two Forwards),
  and only then free again, so a new session never inherits stale KV;
- sessions on the worker's data plane (``bind_data_plane``): their steps go worker to worker,
  not through this table, until the shell unbinds them (``unbound``: what the worker did comes
  back into the session); one that ends while bound is unbound by the shell before its sequence
  is removed (``take_unbinding``), so no step of it can reach a sequence given to another.

Pure: ``now_ms`` comes in as an argument. Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import dataclasses

from agent._proto import swarm_pb2
from agent.core.node.batching import is_prefill
from agent.core.wire.swarm_wire import WireError

__all__ = ["NodeSession", "SessionTable", "trusted_reserve"]

Code = swarm_pb2.Error.Code


def trusted_reserve(n_seq_max: int, share: float, any_trusted: bool) -> int:
    """Sequences of a range kept for trusted owners: ``share`` of them, at least one, and never
    all (an untrusted owner can always get one); none when the node trusts no owner."""
    if not any_trusted or n_seq_max < 2:
        return 0
    return min(n_seq_max - 1, max(1, int(share * n_seq_max)))


@dataclasses.dataclass
class NodeSession:
    session_id: bytes
    seq_id: int
    owner_peer_id: str
    next_step: int
    next_position: int
    last_used_ms: int
    last_step_ms: int = 0  # its last step (or rebuild, resume, progress on the data plane): touches do not count
    trusted: bool = False  # its owner is one the node trusts: it may use the reserve
    bound_steps_seen: int = 0  # on the data plane: the worker's next step when progress was last noted
    source_host: str = ""  # the address that opened it, where counted (agent.core.wire.address_rate.counted_host)
    pending: int = 0  # steps accepted and not yet done (queued or in a Forward)
    rebuilding: bool = False  # opened by rebuild steps; cleared by its first ordinary step
    rows: int = 0  # rows accepted for it here (prompt, generated, rebuild): the ledger's count
    decoding: bool = False  # its last step was a decode step (one row), not a prompt chunk or rebuild
    data_plane: bool = False  # bound on the worker's data plane: its steps do not come through here
    continued_steps: int = 0  # of its data plane steps, those a last hop's continuation sent (a first hop)


class SessionTable:
    """Sessions of one range.

    Args:
      n_seq_max: sequence ids ``0 .. n_seq_max - 1`` of the worker.
      n_ctx_per_sequence: positions one sequence may hold.
      max_per_owner: the most sessions one untrusted owner may hold at once (None: all of them).
      reserve_for_trusted: sequences only trusted owners may take: untrusted ones together
        hold at most ``n_seq_max - reserve_for_trusted`` (0: no reserve).
    """

    def __init__(
        self, n_seq_max: int, n_ctx_per_sequence: int, *, max_per_owner: int | None = None, reserve_for_trusted: int = 0
    ) -> None:
        if n_seq_max < 1:
            raise ValueError(f"n_seq_max must be >= 1, got {n_seq_max}")
        if max_per_owner is not None and max_per_owner < 1:
            raise ValueError(f"max_per_owner must be >= 1, got {max_per_owner}")
        if not 0 <= reserve_for_trusted < n_seq_max:
            raise ValueError(f"reserve_for_trusted must be in [0, {n_seq_max}), got {reserve_for_trusted}")
        self.max_per_owner = max_per_owner or n_seq_max
        self.reserve_for_trusted = reserve_for_trusted
        self.n_seq_max = n_seq_max
        self.n_ctx_per_sequence = n_ctx_per_sequence
        self._sessions: dict[bytes, NodeSession] = {}
        self._free: list[int] = list(range(n_seq_max - 1, -1, -1))  # pop() gives the lowest id
        self._closing: list[int] = []
        self._unbinding: list[tuple[bytes, int]] = []  # (session, sequence) ended while bound on the data plane
        self.started = 0  # sessions opened by a step 0
        self.resumed = 0  # sessions that kept their cache through a resume
        self.rebuilt = 0  # sessions opened by rebuild steps

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def get(self, session_id: bytes) -> NodeSession | None:
        return self._sessions.get(session_id)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def decoding_count(self) -> int:
        """Sessions whose last step was a decode step: those a decode group is made of (a
        session still taking its prompt in chunks sends no decode step to wait for)."""
        return sum(session.decoding for session in self._sessions.values())

    def accept(
        self,
        session_id: bytes,
        step: int,
        first_position: int,
        n_rows: int,
        owner_peer_id: str,
        now_ms: int,
        *,
        trusted: bool = False,
        source_host: str = "",
    ) -> NodeSession:
        """Admit a step of ``n_rows`` rows at positions ``first_position ..``; reserve them.

        Raises:
          WireError: INVALID_ARGUMENT (step 0 of a session that exists, a step or position out
            of order), NOT_FOUND (step > 0 of an unknown session), REFUSED (another owner's
            session), RESOURCE_EXHAUSTED (no free sequence, or the context is full).
        """
        session = self._sessions.get(session_id)
        if step == 0:
            if first_position != 0:
                raise WireError(Code.INVALID_ARGUMENT, f"step 0 must start at position 0, got {first_position}")
            if session is None:
                session = self._open(session_id, n_rows, owner_peer_id, now_ms, trusted, source_host)
                self.started += 1
            elif (
                session.next_step == 0 and session.next_position == 0 and not session.data_plane and not session.pending
            ):
                # opened by a data plane bind that took no step (the owner fell back to this path)
                self._check_owner(session, owner_peer_id)
                self._check_context(session_id, 0, n_rows)
            else:
                raise WireError(Code.INVALID_ARGUMENT, f"session {session_id.hex()} already exists (step 0 sent twice)")
        else:
            if session is None:
                raise WireError(Code.NOT_FOUND, f"unknown session {session_id.hex()} at step {step} (no step 0 here)")
            self._check_owner(session, owner_peer_id)
            self._check_not_bound(session, f"step {step}")
            if step != session.next_step:
                raise WireError(
                    Code.INVALID_ARGUMENT,
                    f"session {session_id.hex()}: step {step} out of order (expected {session.next_step})",
                )
            self._check_continues(session, first_position, n_rows, f"step {step} starts")
            session.rebuilding = False
        session.decoding = not is_prefill(n_rows)
        session.next_step = step + 1
        session.next_position = first_position + n_rows
        session.rows += n_rows
        session.pending += 1
        session.last_used_ms = session.last_step_ms = now_ms
        return session

    def _open(
        self, session_id: bytes, n_rows: int, owner_peer_id: str, now_ms: int, trusted: bool, source_host: str = ""
    ) -> NodeSession:
        self._check_context(session_id, 0, n_rows)
        if not self._free:
            raise WireError(
                Code.RESOURCE_EXHAUSTED,
                f"all {self.n_seq_max} sequences of this range are in use"
                + (f" ({len(self._closing)} being freed)" if self._closing else ""),
            )
        held = sum(s.owner_peer_id == owner_peer_id for s in self._sessions.values())
        # a trusted owner (the node's relay: one owner for many users) has no share: the share
        # keeps one peer from locking the others out, and the operator chose to trust this one
        if held >= self.max_per_owner and not trusted:
            raise WireError(
                Code.RESOURCE_EXHAUSTED,
                f"owner {owner_peer_id} holds {held} of this range's {self.n_seq_max} sequences,"
                f" its share (at most {self.max_per_owner})",
            )
        if source_host and not trusted:
            from_host = sum(s.source_host == source_host for s in self._sessions.values())
            if from_host >= self.max_per_owner:
                raise WireError(
                    Code.RESOURCE_EXHAUSTED,
                    f"{from_host} of this range's {self.n_seq_max} sequences are held from {source_host},"
                    f" its share (at most {self.max_per_owner})",
                )
        if not trusted:
            untrusted = sum(not s.trusted for s in self._sessions.values())
            if untrusted >= self.n_seq_max - self.reserve_for_trusted:
                raise WireError(
                    Code.RESOURCE_EXHAUSTED,
                    f"{untrusted} of this range's {self.n_seq_max} sequences are in use; the other"
                    f" {self.reserve_for_trusted} are kept for owners this node trusts",
                )
        session = NodeSession(session_id, self._free.pop(), owner_peer_id, 0, 0, now_ms, now_ms, trusted)
        session.source_host = source_host
        self._sessions[session_id] = session
        return session

    def accept_rebuild(
        self,
        session_id: bytes,
        resume_step: int,
        first_position: int,
        n_rows: int,
        owner_peer_id: str,
        now_ms: int,
        *,
        trusted: bool = False,
    ) -> NodeSession:
        """Admit a rebuild step: ``n_rows`` rows at ``first_position ..`` of a session this range
        replaces. Position 0 opens the session (a sequence id, as a step 0 does); later rebuild
        steps must continue it. Its next ordinary step is ``resume_step``.

        Raises:
          WireError: INVALID_ARGUMENT (position 0 of a session that exists, rows that do not
            continue the rebuild, a rebuild of a session that is not being rebuilt, step 0),
            REFUSED (another owner's session), RESOURCE_EXHAUSTED (no free sequence, or the
            context is full).
        """
        if resume_step < 1:
            raise WireError(Code.INVALID_ARGUMENT, f"a rebuild resumes at step >= 1, got {resume_step}")
        session = self._sessions.get(session_id)
        if first_position == 0:
            if session is not None:
                raise WireError(
                    Code.INVALID_ARGUMENT, f"session {session_id.hex()} already exists: it cannot be rebuilt"
                )
            session = self._open(session_id, n_rows, owner_peer_id, now_ms, trusted)
            session.rebuilding = True
            self.rebuilt += 1
        else:
            if session is None or not session.rebuilding:
                what = "unknown" if session is None else "not being rebuilt"
                raise WireError(
                    Code.INVALID_ARGUMENT,
                    f"session {session_id.hex()} is {what}: rebuild rows at {first_position} refused",
                )
            self._check_owner(session, owner_peer_id)
            self._check_continues(session, first_position, n_rows, "rebuild rows start")
        session.decoding = False
        session.next_step = resume_step
        session.next_position = first_position + n_rows
        session.rows += n_rows
        session.pending += 1
        session.last_used_ms = session.last_step_ms = now_ms
        return session

    def resume(
        self, session_id: bytes, keep_positions: int, next_step: int, owner_peer_id: str, now_ms: int
    ) -> tuple[NodeSession, bool]:
        """Take the session back to positions ``[0, keep_positions)``, expecting ``next_step``.

        Returns:
          ``(session, trim)``: ``trim`` is True when the session held more positions, which the
          shell must then drop from the worker's cache (and from the rows it kept).

        Raises:
          WireError: NOT_FOUND (unknown session), REFUSED (another owner's), UNAVAILABLE (a step
            of it is still queued or in a Forward: ask again once it is done),
            INVALID_ARGUMENT (it holds fewer positions than asked, or ``next_step`` does not
            come after its steps so far).
        """
        session = self._sessions.get(session_id)
        if session is None:
            raise WireError(Code.NOT_FOUND, f"unknown session {session_id.hex()}: nothing to resume")
        self._check_owner(session, owner_peer_id)
        self._check_not_bound(session, "a resume (unbind it first)")
        if session.pending:
            raise WireError(Code.UNAVAILABLE, f"session {session_id.hex()} has a step in a Forward")
        self._check_resume(session, keep_positions, next_step, session.next_position, session.next_step)
        trim = keep_positions < session.next_position
        session.next_position = keep_positions
        session.next_step = next_step
        session.last_used_ms = session.last_step_ms = now_ms
        self.resumed += 1
        return session, trim

    def open_for_data_plane(
        self,
        session_id: bytes,
        n_rows: int,
        owner_peer_id: str,
        now_ms: int,
        *,
        trusted: bool = False,
        source_host: str = "",
    ) -> NodeSession:
        """Open a session whose prompt comes on the data plane (a bind with ``open_rows``): a
        sequence leased to ``owner_peer_id`` and the context checked for ``n_rows``, as its step 0
        would; the shell binds it next, and the worker takes its steps from 0.

        Raises:
          WireError: INVALID_ARGUMENT (the session exists), RESOURCE_EXHAUSTED (as ``accept``).
        """
        if session_id in self._sessions:
            raise WireError(Code.INVALID_ARGUMENT, f"session {session_id.hex()} already exists (opened twice)")
        session = self._open(session_id, n_rows, owner_peer_id, now_ms, trusted, source_host)
        self.started += 1
        return session

    def opened_with_prefix(self, session_id: bytes, positions: int) -> None:
        """A session just opened for the data plane holds ``positions`` positions copied from
        the worker's prefix cache: its prompt steps start there."""
        session = self._sessions.get(session_id)
        if session is None or session.next_step != 0 or session.next_position != 0:
            raise WireError(Code.INVALID_ARGUMENT, "only a session just opened takes a cached prefix")
        if not 0 <= positions <= self.n_ctx_per_sequence:
            raise WireError(Code.INVALID_ARGUMENT, f"a prefix of {positions} positions does not fit the context")
        session.next_position = positions

    def bind_data_plane(self, session_id: bytes, owner_peer_id: str, now_ms: int) -> NodeSession:
        """Mark the session bound on the worker's data plane (the shell binds it there).

        Raises:
          WireError: NOT_FOUND (unknown session), REFUSED (another owner's), UNAVAILABLE (a
            step of it is queued or in a Forward, or it is still being rebuilt: ask again later).
        """
        session = self._sessions.get(session_id)
        if session is None:
            raise WireError(Code.NOT_FOUND, f"unknown session {session_id.hex()}: nothing to bind")
        self._check_owner(session, owner_peer_id)
        if session.pending:
            raise WireError(Code.UNAVAILABLE, f"session {session_id.hex()} has a step in a Forward")
        if session.rebuilding:
            raise WireError(Code.UNAVAILABLE, f"session {session_id.hex()} is being rebuilt")
        session.data_plane = True
        session.bound_steps_seen = session.next_step
        session.last_used_ms = now_ms
        return session

    def unbound(
        self, session_id: bytes, *, next_step: int, next_position: int, rows: int, now_ms: int, continued_steps: int = 0
    ) -> None:
        """The worker no longer takes the session's steps; what it did while bound: the step
        it expects next, the positions its sequence holds, the rows it computed, the steps it
        took from a greedy continuation."""
        session = self._sessions.get(session_id)
        if session is None or not session.data_plane:
            return
        session.data_plane = False
        session.next_step = max(session.next_step, next_step)
        session.next_position = next_position
        session.rows += rows
        session.continued_steps += continued_steps
        session.decoding = rows > 0 or session.decoding
        session.last_used_ms = now_ms
        if next_step > session.bound_steps_seen:
            session.last_step_ms = now_ms

    def take_unbinding(self) -> list[tuple[bytes, int]]:
        """``(session, sequence)`` of the sessions that ended while bound: unbind each on the
        worker before removing the sequences ``take_closing`` gives, taken together with them
        (each is returned once). A sequence whose session could not be unbound must not be
        released: a step may still reach it."""
        unbinding, self._unbinding = self._unbinding, []
        return unbinding

    @staticmethod
    def _check_not_bound(session: NodeSession, what: str) -> None:
        if session.data_plane:
            raise WireError(
                Code.INVALID_ARGUMENT,
                f"session {session.session_id.hex()} is on the data plane: {what} must go to the worker",
            )

    def check_resume_bound(
        self,
        session_id: bytes,
        keep_positions: int,
        next_step: int,
        owner_peer_id: str,
        *,
        worker_next_position: int,
        worker_next_step: int,
    ) -> None:
        """Whether a resume of a session bound on the data plane would be taken, by what the
        worker says it holds (``UnbindSession`` with ``keep_bound``), before the shell unbinds
        it: a resume that will be refused must change nothing (the session stays bound).

        Raises:
          WireError: as ``resume`` would (NOT_FOUND, REFUSED, INVALID_ARGUMENT).
        """
        session = self._sessions.get(session_id)
        if session is None:
            raise WireError(Code.NOT_FOUND, f"unknown session {session_id.hex()}: nothing to resume")
        self._check_owner(session, owner_peer_id)
        self._check_resume(
            session, keep_positions, next_step, worker_next_position, max(session.next_step, worker_next_step)
        )

    @staticmethod
    def _check_resume(
        session: NodeSession, keep_positions: int, next_step: int, held_positions: int, expected_step: int
    ) -> None:
        if keep_positions > held_positions:
            raise WireError(
                Code.INVALID_ARGUMENT,
                f"session {session.session_id.hex()} holds {held_positions} positions, {keep_positions} asked to keep",
            )
        if next_step < expected_step:
            raise WireError(
                Code.INVALID_ARGUMENT,
                f"session {session.session_id.hex()}: resume at step {next_step}, but step {expected_step - 1} was taken",
            )

    @staticmethod
    def _check_owner(session: NodeSession, owner_peer_id: str) -> None:
        if session.owner_peer_id != owner_peer_id:
            raise WireError(
                Code.REFUSED,
                f"session {session.session_id.hex()} belongs to {session.owner_peer_id}, not {owner_peer_id}",
            )

    def _check_continues(self, session: NodeSession, first_position: int, n_rows: int, what: str) -> None:
        """Rows at ``first_position`` must continue the session, within its context."""
        if first_position != session.next_position:
            raise WireError(
                Code.INVALID_ARGUMENT,
                f"session {session.session_id.hex()}: {what} at position {first_position},"
                f" expected {session.next_position}",
            )
        self._check_context(session.session_id, first_position, n_rows)

    def _check_context(self, session_id: bytes, first_position: int, n_rows: int) -> None:
        if first_position + n_rows > self.n_ctx_per_sequence:
            raise WireError(
                Code.RESOURCE_EXHAUSTED,
                f"session {session_id.hex()}: positions up to {first_position + n_rows} exceed the context of"
                f" {self.n_ctx_per_sequence} positions per sequence",
            )

    def touch(self, session_id: bytes, owner_peer_id: str, now_ms: int) -> bool:
        """Renew the lease of ``session_id`` for its owner; False when it is not held here
        for that owner."""
        session = self._sessions.get(session_id)
        if session is None or session.owner_peer_id != owner_peer_id:
            return False
        session.last_used_ms = now_ms
        return True

    def done(self, session_id: bytes, now_ms: int) -> None:
        """A step of ``session_id`` left the worker (whatever its outcome)."""
        session = self._sessions.get(session_id)
        if session is not None:
            session.pending = max(0, session.pending - 1)
            session.last_used_ms = now_ms

    def end(self, session_id: bytes) -> NodeSession | None:
        """Forget ``session_id``; its sequence id is closing until ``release``. Returns the
        ended session (None if unknown)."""
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._closing.append(session.seq_id)
            if session.data_plane:
                self._unbinding.append((session_id, session.seq_id))
        return session

    def has_closing(self) -> bool:
        return bool(self._closing)

    def take_closing(self) -> list[int]:
        """Sequence ids to remove on the worker now (each is returned once)."""
        closing, self._closing = self._closing, []
        return closing

    def release(self, seq_id: int) -> None:
        """The worker no longer holds ``seq_id``: it may be given to a new session."""
        if not 0 <= seq_id < self.n_seq_max or seq_id in self._free:
            raise ValueError(f"sequence id {seq_id} cannot be released")
        self._free.append(seq_id)
        self._free.sort(reverse=True)

    def note_bound_progress(self, session_id: bytes, worker_next_step: int, now_ms: int) -> None:
        """What the worker says of a session bound on its data plane: the step it expects next.
        A step taken since the last note is progress (``stalled`` does not free it)."""
        session = self._sessions.get(session_id)
        if session is None or not session.data_plane:
            return
        if worker_next_step > session.bound_steps_seen:
            session.bound_steps_seen = worker_next_step
            session.last_step_ms = now_ms

    def stalled(self, now_ms: int, stall_ms: int, *, bound: bool | None = None) -> list[bytes]:
        """Sessions with nothing pending that took no step for at least ``stall_ms``, touched or
        not. ``bound``: only those bound on the data plane (True) or only the others (False)."""
        return [
            s.session_id
            for s in self._sessions.values()
            if s.pending == 0 and now_ms - s.last_step_ms >= stall_ms and (bound is None or s.data_plane == bound)
        ]

    def idle(self, now_ms: int, timeout_ms: int) -> list[bytes]:
        """Sessions with nothing pending, unused for at least ``timeout_ms``."""
        return [
            s.session_id for s in self._sessions.values() if s.pending == 0 and now_ms - s.last_used_ms >= timeout_ms
        ]

    def session_ids(self) -> list[bytes]:
        return list(self._sessions)
