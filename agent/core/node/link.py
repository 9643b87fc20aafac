"""What a node makes of the tracker's answers: registration, heartbeats, re-registration.

Owns, for ``agent.io.node.agent`` (which sends the requests and performs the outcome):
- a registration reply: REFUSED -> ``RegistrationRefused`` (the node stops: restarting would
  only repeat it); any other error, a reply of another kind, a tracker key that does not
  belong to the tracker peer id the node dialled (someone else answered), or an admission
  this node could not use -> ``RegistrationInvalid``; else the tracker key, the admission and
  the heartbeat interval to keep (the node's own setting wins over the tracker's);
- a heartbeat reply: NOT_FOUND (the tracker forgot this node: restarted without it, expired
  its admission, or refused it since) -> register again, then heartbeat at once; another error
  -> a warning, and the next heartbeat as usual; else the directives to apply in order and a
  refreshed admission to adopt if it verifies (one that does not is ignored with a warning: the
  current one stays until it expires);
- the retry delay while the tracker cannot be reached at start: doubling up to a cap.

Pure: ``now_ms`` (unix ms: admissions carry the tracker's wall-clock times) comes in. Must not
import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import dataclasses

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.wire.admission import AdmissionError, verify_admission
from agent.core.wire.swarm_wire import WireError

__all__ = [
    "HeartbeatOutcome",
    "Registration",
    "RegistrationInvalid",
    "RegistrationRefused",
    "next_retry_delay_s",
    "read_heartbeat_reply",
    "read_registration_reply",
]

Code = swarm_pb2.Error.Code


class RegistrationRefused(Exception):
    """The tracker refused this node; ``reason`` is its text; ``work_bits``: it asks this new
    identity for a proof of work of this many bits (``Error.work_bits``; 0: not that)."""

    def __init__(self, reason: str, work_bits: int = 0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.work_bits = work_bits


class RegistrationInvalid(Exception):
    """The tracker's answer cannot be used (an error, the wrong key, an unusable admission)."""


@dataclasses.dataclass(frozen=True)
class Registration:
    tracker_public_key: bytes
    admission: swarm_pb2.SignedAdmission
    heartbeat_interval_ms: int | None  # None: keep the interval the node has


def read_registration_reply(
    reply: swarm_pb2.TrackerReply,
    *,
    tracker_peer_id: str,
    peer_id: str,
    now_ms: int,
    own_heartbeat_interval: bool,
) -> Registration:
    """Raises RegistrationRefused or RegistrationInvalid (module docstring)."""
    if reply.error.code == Code.REFUSED:
        raise RegistrationRefused(reply.error.message, reply.error.work_bits)
    if reply.error.code:
        raise RegistrationInvalid(f"tracker refused registration: {WireError(reply.error.code, reply.error.message)}")
    if reply.WhichOneof("body") != "register":
        raise RegistrationInvalid(f"tracker answered registration with {reply.WhichOneof('body')!r}")
    registered = reply.register
    tracker_key = bytes(registered.tracker_public_key)
    try:
        key_peer_id = peer_id_from_public_key(tracker_key)
    except ValueError as err:
        raise RegistrationInvalid(f"tracker public key: {err}") from None
    if key_peer_id != tracker_peer_id:
        raise RegistrationInvalid(
            f"the tracker's key belongs to {key_peer_id}, not to the tracker {tracker_peer_id} dialled"
        )
    try:
        verify_admission(registered.admission, tracker_key, peer_id, now_ms, roles=[swarm_pb2.ROLE_NODE])
    except AdmissionError as err:
        raise RegistrationInvalid(f"tracker issued an unusable admission: {err.reason}") from None
    interval = (
        registered.heartbeat_interval_ms if registered.heartbeat_interval_ms and not own_heartbeat_interval else None
    )
    return Registration(tracker_key, registered.admission, interval)


@dataclasses.dataclass(frozen=True)
class HeartbeatOutcome:
    register_again: bool = False
    admission: swarm_pb2.SignedAdmission | None = None  # a verified refresh to adopt
    directives: tuple[swarm_pb2.Directive, ...] = ()
    warning: str = ""  # for the log ("" when all is well)


def read_heartbeat_reply(
    reply: swarm_pb2.TrackerReply, *, tracker_public_key: bytes, peer_id: str, now_ms: int
) -> HeartbeatOutcome:
    if reply.error.code == Code.NOT_FOUND:
        return HeartbeatOutcome(
            register_again=True, warning=f"tracker does not know this node ({reply.error.message}): registering again"
        )
    if reply.error.code:
        return HeartbeatOutcome(warning=f"heartbeat refused: {WireError(reply.error.code, reply.error.message)}")
    beat = reply.heartbeat
    admission = None
    warning = ""
    if beat.HasField("admission") and beat.admission.record:
        try:
            verify_admission(beat.admission, tracker_public_key, peer_id, now_ms, roles=[swarm_pb2.ROLE_NODE])
        except AdmissionError as err:
            warning = f"ignoring a refreshed admission: {err.reason}"
        else:
            admission = beat.admission
    return HeartbeatOutcome(admission=admission, directives=tuple(beat.directives), warning=warning)


def next_retry_delay_s(delay_s: float, max_s: float) -> float:
    """The wait after ``delay_s`` while the tracker stays unreachable."""
    return min(delay_s * 2, max_s)
