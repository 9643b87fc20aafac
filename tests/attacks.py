"""What the adversarial tests' attackers do (not a test module): a self-admitted client opening
a one-token session on a route's first hop, as any program with its own key can; a peer that
never asked for admission flooding a listener with big request frames; and reading the attacked
process's memory."""

from __future__ import annotations

import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from agent._proto import swarm_pb2
from agent.core.net.frames import encode_uvarint
from agent.core.wire.step_requests import first_step_request
from agent.core.wire.swarm_wire import STEP_PROTOCOL, parse_record
from agent.io.client import SwarmClient


async def open_one_token_session(client: SwarmClient, route: swarm_pb2.Route, session_id: bytes) -> swarm_pb2.StepAck:
    """Send step 0 of ``session_id`` (one token) to ``route``'s first hop as ``client``; the ack."""
    first = route.hops[0]
    request = first_step_request(
        session_id=session_id, step=0, hops=route.hops, token_ids=[1], first_position=0,
        recipe_hash=route.recipe_hash, model_sha256=route.model_sha256,
        owner_peer_id=client.peer_id, owner_addrs=client.transport.listen_addrs,
        sender_admission=client.admission, result_top_k=1,
    )  # fmt: skip
    raw = await client.transport.request(
        first.peer_id, list(first.addrs), STEP_PROTOCOL, request.SerializeToString(), timeout_s=30
    )
    return parse_record(swarm_pb2.StepAck, raw)


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` now (Linux ``/proc``)."""
    return _status_kib(pid, "VmRSS") * 1024


def reset_peak_rss(pid: int) -> bool:
    """Start ``pid``'s peak resident memory (``VmHWM``) afresh from its RSS now; False where the
    kernel does not allow it (then ``peak_rss_bytes`` is the peak since the process started)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes(pid: int) -> int:
    """The peak resident memory of ``pid`` since it started or since ``reset_peak_rss``."""
    return _status_kib(pid, "VmHWM") * 1024


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise LookupError(f"/proc/{pid}/status has no {field}")


async def flood_frames(
    host: IHost, peer_id: str, protocol_id: str, *, streams: int, frame_bytes: int, ignore_window: bool = False
) -> list[int]:
    """Open ``streams`` streams on ``protocol_id`` to ``peer_id`` (already connected) at once and
    send a request frame of ``frame_bytes`` on each (the length prefix with the body's first
    MiB, then the rest a MiB at a time), as a peer that skips admission would; the bytes each stream got written
    before the listener reset it (``frame_bytes`` + prefix: all of it was taken in)."""
    remote = ID.from_base58(peer_id)
    chunk = bytes(1 << 20)
    sent = [0] * streams

    async def one(i: int) -> None:
        try:
            stream = await host.new_stream(remote, [TProtocol(protocol_id)])
            if ignore_window:  # as a peer whose yamux does not wait for window updates
                stream.muxed_stream.send_window = 1 << 40  # type: ignore[attr-defined]
            prefix = encode_uvarint(frame_bytes)
            left = frame_bytes
            while left:  # the prefix goes with the first MiB: no round trip to refuse it in
                piece = chunk[: min(left, len(chunk))]
                await stream.write(prefix + piece)
                sent[i] += len(prefix) + len(piece)
                left -= len(piece)
                prefix = b""
            await stream.read(1)  # the listener's answer or reset
        except Exception:  # reset by the listener: what a refusal looks like to the sender
            return

    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(one, i)
    return sent


async def settled_rss_bytes(pid: int, *, within_bytes: int = 4 << 20, for_s: float = 2.0, timeout_s: float = 90) -> int:
    """``pid``'s RSS once it has stayed within ``within_bytes`` for ``for_s`` (a process that has
    just started, or just served, still grows and shrinks: a baseline is taken after that)."""
    samples: list[tuple[float, int]] = []
    with trio.fail_after(timeout_s):
        while True:
            now = trio.current_time()
            samples = [(t, rss) for t, rss in samples if now - t <= for_s] + [(now, rss_bytes(pid))]
            values = [rss for _, rss in samples]
            if now - samples[0][0] >= for_s * 0.9 and max(values) - min(values) <= within_bytes:
                return values[-1]
            await trio.sleep(0.1)  # (sampling memory, not a synchronisation)
