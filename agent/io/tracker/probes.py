"""Lost-peer probes: an owner reports a peer it lost (``report_lost_peer``); the tracker
probes it and marks it dead at once when it does not answer either, instead of waiting for
its heartbeat deadline.

The rules are the tracker's reducer's (``agent.core.tracker.reducer``: ``PeerReported``
makes a live peer a suspect and asks for one probe, ``ProbeEnded`` without an answer marks it
dead); this shell dials the probe and owns what is in flight: one ``_Probe`` per suspect, whose
verdict the reports that arrive while it runs share (a burst of reports cannot turn into a
burst of dials).

Must not import ``agent.io.tracker.service`` (which holds a ``LostPeerProbes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import trio

from agent._proto import swarm_pb2
from agent.core.tracker import state as ev
from agent.core.wire.swarm_wire import NODE_PROTOCOL, SCHEMA_VERSION
from agent.io.net.transport import TransportError
from agent.io.tracker.refusal import Refusal
from agent.io.tracker.store import TrackerStore

__all__ = ["LostPeerProbes"]

Code = swarm_pb2.Error


class LostPeerProbes:
    """Made by ``Tracker`` (its ``lost_peers``): ``transport`` dials the probes (within
    ``timeout_s``); ``apply(event)`` is the tracker's (the reducer fed, its effects done)."""

    def __init__(
        self,
        transport,
        store: TrackerStore,
        timeout_s: float,
        apply: Callable[[ev.Event], list[ev.Effect]],
    ) -> None:
        self.transport = transport
        self.store = store
        self._timeout_s = timeout_s
        self._apply = apply
        self._probes: dict[str, _Probe] = {}

    async def report(
        self, remote_peer_id: str, report: swarm_pb2.ReportLostPeerRequest
    ) -> swarm_pb2.ReportLostPeerReply:
        """Probe a peer an owner lost; mark it dead now if it does not answer either.

        One probe per peer at a time: reports that arrive while one runs share its verdict.

        Cancellation: a cancelled probe ends the suspicion without a verdict (the peer stays
        alive); reports waiting on it hear "no answer"."""
        peer = report.peer_id
        effects = self._apply(ev.PeerReported(peer, remote_peer_id, report.reason))
        for effect in effects:
            if isinstance(effect, ev.Refuse):
                raise Refusal(effect.code, effect.message)
            if isinstance(effect, ev.ReportAnswered):
                return swarm_pb2.ReportLostPeerReply(confirmed=effect.confirmed, detail=effect.detail)
        if any(isinstance(effect, ev.ProbePeer) for effect in effects):
            probe = self._probes[peer] = _Probe()
            node = self.store.node(peer)
            addrs = list(node.listen_addrs) if node is not None else []
            verdict: bool | None = None  # None: cancelled, no verdict
            try:
                await self.transport.request(peer, addrs, NODE_PROTOCOL, _PROBE, timeout_s=self._timeout_s)
                probe.answered = verdict = True
            except TransportError as error:
                probe.error = str(error)
                verdict = False
            finally:
                del self._probes[peer]
                probe.done.set()
                self._apply(ev.ProbeEnded(peer, verdict, remote_peer_id, report.reason))
        else:  # a probe of this suspect is under way
            probe = self._probes[peer]
            await probe.done.wait()
        if probe.answered:
            return swarm_pb2.ReportLostPeerReply(confirmed=False, detail="the peer answered the tracker's probe")
        return swarm_pb2.ReportLostPeerReply(confirmed=True, detail=f"no answer to the tracker's probe: {probe.error}")


@dataclasses.dataclass
class _Probe:
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    answered: bool = False
    error: str = ""


# Any answer proves the peer's node handler runs: a NodeRequest with no body is answered with
# INVALID_ARGUMENT at once by a live node (no admission needed to be refused).
_PROBE = swarm_pb2.NodeRequest(schema_version=SCHEMA_VERSION).SerializeToString()
