"""Lost-peer probes: an owner reports a peer it lost (``report_lost_peer``); the tracker
probes it and marks it dead at once when it does not answer either, instead of waiting for
its heartbeat deadline.

Owns the probes in flight (one per peer at a time: reports that arrive while one runs share
its verdict, so a burst of reports cannot turn into a burst of dials). Liveness and the store
are the ``Tracker``'s; it hands in how to mark a peer dead.

Must not import ``agent.io.tracker.service`` (which holds a ``LostPeerProbes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import trio

from agent._proto import swarm_pb2
from agent.core.tracker.liveness import Liveness
from agent.core.wire.swarm_wire import NODE_PROTOCOL, SCHEMA_VERSION
from agent.io.net.transport import TransportError
from agent.io.tracker.refusal import Refusal
from agent.io.tracker.store import TrackerStore

__all__ = ["LostPeerProbes"]

Code = swarm_pb2.Error


class LostPeerProbes:
    """Made by ``Tracker`` (its ``lost_peers``): ``transport`` dials the probes (within
    ``timeout_s``); ``mark_dead(peers, why)`` is the tracker's."""

    def __init__(
        self,
        transport,
        store: TrackerStore,
        liveness: Liveness,
        timeout_s: float,
        mark_dead: Callable[[list[str], str], None],
    ) -> None:
        self.transport = transport
        self.store = store
        self.liveness = liveness
        self._timeout_s = timeout_s
        self._mark_dead = mark_dead
        self._probes: dict[str, _Probe] = {}

    async def report(
        self, remote_peer_id: str, report: swarm_pb2.ReportLostPeerRequest
    ) -> swarm_pb2.ReportLostPeerReply:
        """Probe a peer an owner lost; mark it dead now if it does not answer either.

        One probe per peer at a time: reports that arrive while one runs share its verdict
        (a burst of reports cannot turn into a burst of dials)."""
        peer = report.peer_id
        if not peer:
            raise Refusal(Code.INVALID_ARGUMENT, "ReportLostPeerRequest.peer_id is empty")
        if peer not in self.liveness:
            return swarm_pb2.ReportLostPeerReply(confirmed=peer in self._known_dead(), detail="not a live node")
        probe = self._probes.get(peer)
        if probe is None:
            probe = self._probes[peer] = _Probe()
            node = self.store.node(peer)
            addrs = list(node.listen_addrs) if node is not None else []
            try:
                await self.transport.request(peer, addrs, NODE_PROTOCOL, _PROBE, timeout_s=self._timeout_s)
                probe.answered = True
            except TransportError as error:
                probe.error = str(error)
            finally:
                del self._probes[peer]
                probe.done.set()
            if not probe.answered and peer in self.liveness:
                self._mark_dead(
                    [peer], f"{remote_peer_id} lost it ({report.reason[:200]}) and it does not answer a probe"
                )
        else:
            await probe.done.wait()
        if probe.answered:
            return swarm_pb2.ReportLostPeerReply(confirmed=False, detail="the peer answered the tracker's probe")
        return swarm_pb2.ReportLostPeerReply(confirmed=True, detail=f"no answer to the tracker's probe: {probe.error}")

    def _known_dead(self) -> set[str]:
        return {n.peer_id for n in self.store.nodes() if not n.alive}


@dataclasses.dataclass
class _Probe:
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    answered: bool = False
    error: str = ""


# Any answer proves the peer's node handler runs: a NodeRequest with no body is answered with
# INVALID_ARGUMENT at once by a live node (no admission needed to be refused).
_PROBE = swarm_pb2.NodeRequest(schema_version=SCHEMA_VERSION).SerializeToString()
