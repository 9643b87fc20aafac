"""How well the lab does what it is told: round trip, loss and bandwidth between two machines,
measured with real sockets of the machines (made in them, used from this process's threads).

- ``tcp_rtt_ms``: a 64-byte TCP ping-pong (TCP_NODELAY), each exchange timed;
- ``udp_loss_pct``: numbered datagrams sent at a steady pace, the share that never arrived;
- ``tcp_goodput_mbit``: one TCP stream for a while, payload bytes per second at the receiver
  after the first quarter (slow start excluded).

Used by the lab's tests and ``bench/wan.py`` (its "lab accuracy" table).
"""

from __future__ import annotations

import socket
import struct
import threading
import time

from .harness import Lab

__all__ = ["tcp_goodput_mbit", "tcp_rtt_ms", "udp_loss_pct"]

_PORT_ANY = 0


def _pair(lab: Lab, a: str, b: str) -> tuple[socket.socket, socket.socket]:
    """A connected TCP pair: (the socket of ``a``, the socket of ``b``)."""
    listener = lab.run_in(b, lambda: socket.create_server((lab.address(b), _PORT_ANY)))
    with listener:
        port = listener.getsockname()[1]
        client = lab.run_in(a, lambda: socket.create_connection((lab.address(b), port), timeout=30))
        listener.settimeout(30)
        server, _ = listener.accept()
    for s in (client, server):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(30)
    return client, server


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed mid-message")
        data += chunk
    return data


def tcp_rtt_ms(lab: Lab, a: str, b: str, count: int = 50, payload_bytes: int = 64) -> list[float]:
    """``count`` round trips of ``payload_bytes`` from ``a`` to ``b`` and back, in ms each (after
    one unmeasured exchange that warms the connection)."""
    client, server = _pair(lab, a, b)
    message = b"x" * payload_bytes
    rtts = []
    with client, server:
        for i in range(count + 1):
            start = time.perf_counter()
            client.sendall(message)
            server.sendall(_recv_exactly(server, payload_bytes))
            _recv_exactly(client, payload_bytes)
            if i:
                rtts.append((time.perf_counter() - start) * 1000)
    return rtts


def udp_loss_pct(lab: Lab, a: str, b: str, count: int = 5000, pace_s: float = 0.0002, settle_s: float = 1.0) -> float:
    """Percent of ``count`` numbered datagrams from ``a`` that ``b`` did not receive (sent one
    every ``pace_s``; ``settle_s`` after the last for stragglers)."""
    receiver = lab.run_in(b, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    sender = lab.run_in(a, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    with receiver, sender:
        receiver.bind((lab.address(b), _PORT_ANY))
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        target = (lab.address(b), receiver.getsockname()[1])
        seen: set[int] = set()
        done = threading.Event()

        def receive() -> None:
            receiver.settimeout(0.05)
            while not done.is_set():
                try:
                    data = receiver.recv(64)
                except TimeoutError:
                    continue
                seen.add(struct.unpack("<I", data[:4])[0])

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        next_send = time.perf_counter()
        for i in range(count):
            sender.sendto(struct.pack("<I", i) + b"." * 60, target)
            next_send += pace_s
            pause = next_send - time.perf_counter()
            if pause > 0:
                time.sleep(pause)  # pacing the sender, not synchronising with anything
        time.sleep(settle_s)  # the last datagrams' one-way delay: nothing announces a loss
        done.set()
        thread.join()
    return 100.0 * (count - len(seen)) / count


def tcp_goodput_mbit(lab: Lab, a: str, b: str, seconds: float = 4.0) -> float:
    """Payload Mbit/s of one TCP stream ``a`` -> ``b``, measured at ``b`` over the last three
    quarters of ``seconds``."""
    client, server = _pair(lab, a, b)
    stop = threading.Event()
    marks: list[tuple[float, int]] = []

    def send() -> None:
        block = b"\0" * 65536
        try:
            while not stop.is_set():
                client.sendall(block)
        except OSError:
            pass

    with client, server:
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        received = 0
        start = time.perf_counter()
        warm_end = start + seconds / 4
        end = start + seconds
        while (now := time.perf_counter()) < end:
            received += len(server.recv(1 << 20))
            if now >= warm_end and not marks:
                marks.append((now, received))
        marks.append((time.perf_counter(), received))
        stop.set()
        client.shutdown(socket.SHUT_RDWR)
        sender.join()
    (t0, b0), (t1, b1) = marks[0], marks[-1]
    return (b1 - b0) * 8 / (t1 - t0) / 1e6
