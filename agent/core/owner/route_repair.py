"""What a session's route becomes around a lost hop, and how a session's end goes along it.

Owns: the resume plan (which hops survive with their caches, which part of the route the
tracker must replace, and who feeds the replacement its rows), the hops that survive a set of
lost peers, and the end-session request that walks a route.

Pure: protobuf records in, protobuf records out. Must not import trio, grpc, libp2p, sockets,
clocks or agent.io.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from agent._proto import swarm_pb2
from agent.core.wire.swarm_wire import SCHEMA_VERSION

__all__ = ["ResumePlan", "end_session_request", "resume_plan", "surviving_hops"]


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """How a session goes on after losing a peer: hops ``[first_lost, last_lost]`` of the
    route (blocks ``[begin, end)``) are replaced by a route part the tracker plans; the other
    hops (``survivors``) keep their caches of ``keep_positions``; the replacement is rebuilt
    from the rows the hop before it kept (``feeder``), or from the owner's tokens when the
    first hop was lost (``feeder`` None)."""

    first_lost: int
    last_lost: int
    begin: int
    end: int
    keep_positions: int
    survivors: tuple[swarm_pb2.Hop, ...]
    feeder: swarm_pb2.Hop | None

    def route_with(self, route: swarm_pb2.Route, replacement: Sequence[swarm_pb2.Hop]) -> swarm_pb2.Route:
        """``route`` with the lost hops replaced by ``replacement`` (which must cover
        ``[begin, end)`` exactly).

        Raises:
          ValueError: the replacement does not cover the lost blocks.
        """
        at = self.begin
        for hop in replacement:
            if hop.begin != at or hop.end <= hop.begin:
                raise ValueError(f"the replacement hop [{hop.begin}, {hop.end}) does not continue at block {at}")
            at = hop.end
        if at != self.end or not replacement:
            raise ValueError(f"the replacement covers blocks [{self.begin}, {at}), not [{self.begin}, {self.end})")
        hops = list(route.hops[: self.first_lost]) + list(replacement) + list(route.hops[self.last_lost + 1 :])
        new = swarm_pb2.Route()
        new.CopyFrom(route)
        del new.hops[:]
        new.hops.extend(hops)
        return new


def resume_plan(route: swarm_pb2.Route, lost_peer: str, keep_positions: int) -> ResumePlan | None:
    """Whether a session that lost ``lost_peer`` can resume on ``route`` keeping
    ``keep_positions`` (None: re-prefill a new route instead): there must be something to keep,
    the lost peer's hops must be one contiguous part of the route, and some hop must survive."""
    lost = [i for i, hop in enumerate(route.hops) if hop.peer_id == lost_peer]
    if keep_positions < 1 or not lost or lost != list(range(lost[0], lost[-1] + 1)):
        return None
    first, last = lost[0], lost[-1]
    survivors = tuple(hop for i, hop in enumerate(route.hops) if not first <= i <= last)
    if not survivors:
        return None
    return ResumePlan(
        first_lost=first,
        last_lost=last,
        begin=route.hops[first].begin,
        end=route.hops[last].end,
        keep_positions=keep_positions,
        survivors=survivors,
        feeder=route.hops[first - 1] if first > 0 else None,
    )


def surviving_hops(route: swarm_pb2.Route, lost_peers: Iterable[str] = ()) -> list[swarm_pb2.Hop]:
    """The hops of ``route`` not run by a lost peer (where an end-session can still go)."""
    lost = set(lost_peers)
    return [hop for hop in route.hops if hop.peer_id not in lost]


def end_session_request(
    session_id: bytes,
    route: swarm_pb2.Route,
    admission: swarm_pb2.SignedAdmission,
    lost_peers: Iterable[str] = (),
) -> swarm_pb2.NodeRequest:
    """The ``NodeRequest`` to the first surviving hop that frees the session on every surviving
    hop of ``route``: a lost peer is skipped, so that ending a session never waits on it."""
    return swarm_pb2.NodeRequest(
        schema_version=SCHEMA_VERSION,
        sender_admission=admission,
        end_session=swarm_pb2.EndSessionRequest(
            session_id=bytes(session_id), rest=surviving_hops(route, lost_peers)[1:]
        ),
    )
