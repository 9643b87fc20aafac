"""py-libp2p's circuit relay v2 made safe for Baton: who may reserve and connect, and the
workarounds that keep one circuit's end from tearing down another.

Owns: ``RelayPolicy`` (who may reserve / open circuits), ``GatedRelayProtocol`` (the relay's
RESERVE and CONNECT behind that policy, reservations only in the connection's own name, one
key per relayed direction), the filter for the relay's noisy end-of-stream log lines, and
``NoAutoConnector`` (py-libp2p's auto-dialler, never started). Split out of ``agent.io.net.p2p``
(which builds the host and carries requests); nothing here frames or dials.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from libp2p.abc import INetStream
from libp2p.network.auto_connector import AutoConnector
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode

__all__ = ["GatedRelayProtocol", "NoAutoConnector", "RelayPolicy"]

log = logging.getLogger("agent.io.net.p2p")


@dataclass(frozen=True)
class RelayPolicy:
    """Who may use a relay (a host opened with ``enable_relay_hop=True``); both take a peer id.

    ``may_reserve``: may hold a reservation, i.e. be reachable through this relay (asked on
    every RESERVE and refresh, and again for the destination of every CONNECT, so a peer that
    lost the right stops being reachable at once). ``may_connect``: may open circuits through
    this relay (the source of a CONNECT). Neither may block: they run inside the relay's
    stream handlers.
    """

    may_reserve: Callable[[str], bool]
    may_connect: Callable[[str], bool]

    @classmethod
    def open(cls) -> RelayPolicy:
        """Anyone may reserve and connect (py-libp2p's own behaviour)."""
        return cls(lambda _peer: True, lambda _peer: True)

    @classmethod
    def closed(cls) -> RelayPolicy:
        """Nobody may (e.g. until the tracker that decides is running)."""
        return cls(lambda _peer: False, lambda _peer: False)


class GatedRelayProtocol(CircuitV2Protocol):
    """py-libp2p's circuit relay v2 with a ``RelayPolicy`` in front of RESERVE and CONNECT.

    py-libp2p 0.8.1 has no ACL hook: ``RelayResourceManager`` only counts reservations, and
    ``_handle_reserve`` takes the reserving peer from the message's optional ``peer`` field (a
    peer could reserve in another's name). Here a RESERVE is accepted only for the
    connection's authenticated peer, when ``may_reserve`` says so; a CONNECT only from a
    source ``may_connect`` accepts, to a destination ``may_reserve`` still accepts. Refusals
    answer PERMISSION_DENIED. Also: the end of one circuit no longer tears down another
    circuit to the same peer (``_relay_data``).
    """

    def __init__(self, *args: Any, policy: Callable[[], RelayPolicy], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._policy = policy

    async def _refuse(self, stream: INetStream, message: str) -> None:
        # As py-libp2p's own refusals: the status only; the requester closes the stream.
        log.info("relay: %s", message)
        await self._send_status(stream, StatusCode.PERMISSION_DENIED, message)

    async def _handle_reserve(self, stream: INetStream, msg: HopMessage) -> None:
        remote = stream.muxed_conn.peer_id
        if msg.HasField("peer") and msg.peer.id and bytes(msg.peer.id) != remote.to_bytes():
            await self._refuse(stream, f"{remote} asked for a reservation in another peer's name")
            return
        if not self._policy().may_reserve(str(remote)):
            await self._refuse(stream, f"reservation refused to {remote} (not admitted)")
            return
        await super()._handle_reserve(stream, msg)

    async def _handle_connect(self, stream: INetStream, msg: HopMessage) -> None:
        source = str(stream.muxed_conn.peer_id)
        policy = self._policy()
        if not policy.may_connect(source):
            await self._refuse(stream, f"circuit refused to {source} (not admitted)")
            return
        try:
            destination = str(ID(msg.peer.id))
        except Exception:
            destination = "?"
        if destination == "?" or not policy.may_reserve(destination):
            await self._refuse(stream, f"circuit from {source} to {destination} refused (destination not admitted)")
            return
        await super()._handle_connect(stream, msg)

    async def _relay_data(
        self,
        src_stream: INetStream,
        dst_stream: INetStream,
        peer_id: ID,
        deadline: float | None = None,
        circuit_data_limit: list[int] | None = None,
    ) -> None:
        # py-libp2p keys ``_active_relays`` by peer id, and when one direction of a circuit
        # ends it closes whatever circuit that id maps to: with two circuits to one peer (two
        # upstream nodes, or a client and a node), the end of one tore down the other. Here
        # each direction gets a key of its own that holds its own circuit's streams.
        key = _CircuitKey(peer_id)
        self._active_relays[key] = (src_stream, dst_stream)  # type: ignore[index]
        try:
            await super()._relay_data(src_stream, dst_stream, key, deadline, circuit_data_limit)  # type: ignore[arg-type]
        finally:
            self._active_relays.pop(key, None)  # type: ignore[call-overload]
            shared = self._active_relays.get(peer_id)
            if shared is not None and any(s is not None and s in (src_stream, dst_stream) for s in shared):
                del self._active_relays[peer_id]


class _CircuitKey:
    """One relayed direction's key in ``CircuitV2Protocol._active_relays`` (prints as the peer)."""

    __slots__ = ("peer_id",)

    def __init__(self, peer_id: ID) -> None:
        self.peer_id = peer_id

    def __str__(self) -> str:
        return str(self.peer_id)


# py-libp2p's relay handler reads a HOP stream until it fails, and logs the normal end of a
# stream (the peer closed it after its one RESERVE or after a refusal, or a circuit ended) as
# ERRORs whose text is empty (EOF) or "stream is reset". Only those lines are dropped.
_RELAY_STREAM_END = re.compile(
    r"^(Error reading from hop stream from \S+|Unexpected error handling hop stream from \S+"
    r"|Unexpected error reading from stream|Error sending status message|Error writing to destination stream"
    r"|Error relaying data)"
    r": (|Cannot (read from|write to) stream; stream is reset)$"
)


class _RelayStreamEndFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _RELAY_STREAM_END.match(record.getMessage())


_relay_protocol_log = logging.getLogger("libp2p.relay.circuit_v2.protocol")
if not any(isinstance(f, _RelayStreamEndFilter) for f in _relay_protocol_log.filters):
    _relay_protocol_log.addFilter(_RelayStreamEndFilter())


class NoAutoConnector(AutoConnector):
    """py-libp2p's AutoConnector, never started: by default every host dials peers from its
    peerstore until it holds 200 connections (the midpoint of its watermarks) and logs that
    every 10 s. Baton dials whom it needs, explicitly."""

    async def start(self) -> None:
        self._started = False
