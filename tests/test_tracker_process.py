"""The tracker as a real process over the real libp2p transport: serve, kill -9, restart.

Starts ``python -m agent.io.tracker.cli serve`` with a tiny real GGUF registered, reads its
first stdout line and --addr-file, lists models, fetches a model's metadata and registers a
node over libp2p, lists nodes, kills the process (SIGKILL: no graceful shutdown), restarts it
on the same --db / --key / port without --register-model, and checks that the peer id, the
model (and its metadata, read from the recorded file), the node (pending until it heartbeats)
and its assignment are still there. Finally a SIGTERM stops it with exit status 0, and
``baton tracker models`` / ``nodes`` read the database.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.net.multiaddrs import peer_id_from_multiaddr
from agent.core.wire.admission import sign_fingerprint
from agent.core.wire.swarm_wire import TRACKER_PROTOCOL
from agent.io.keys import public_key_bytes
from agent.io.net.p2p import open_p2p_transport
from agent.runtime import expected_pin

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0  # reading + hashing the GGUF, importing libp2p
REQUEST_TIMEOUT_S = 20.0

pytestmark = [pytest.mark.worker, pytest.mark.slow]


class TrackerProcess:
    def __init__(self, tmp_path: Path, extra: list[str], listen: str) -> None:
        self.addr_file = tmp_path / "tracker.addr"
        self.stderr_path = tmp_path / f"tracker-{len(list(tmp_path.glob('tracker-*.log')))}.log"
        self.argv = [
            sys.executable, "-m", "agent.io.tracker.cli", "serve",
            "--db", str(tmp_path / "tracker.db"), "--key", str(tmp_path / "keys" / "tracker.key"),
            "--listen", listen, "--addr-file", str(self.addr_file), "--heartbeat-timeout-ms", "60000",
            *extra,
        ]  # fmt: skip
        self.process: trio.Process | None = None
        self.first_line = ""
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 (closed in close())

    async def start(self) -> str:
        self.addr_file.unlink(missing_ok=True)
        self.process = await trio.lowlevel.open_process(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        buffer = b""
        with trio.move_on_after(START_TIMEOUT_S):
            while b"\n" not in buffer:
                chunk = await self.process.stdout.receive_some(4096)
                if not chunk:
                    break  # the process exited
                buffer += chunk
        self.first_line = buffer.split(b"\n", 1)[0].decode()
        assert self.first_line.startswith("tracker listening on "), (
            f"first stdout line {self.first_line!r}; stderr:\n{self.stderr_path.read_text()}"
        )
        addr = self.first_line.removeprefix("tracker listening on ")
        assert self.addr_file.read_text() == addr + "\n"  # written (atomically) once listening
        return addr

    async def stop(self, sig: int) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        with trio.fail_after(30):
            return await self.process.wait()

    async def close(self) -> None:
        """Kill the process if it still runs, reap it, close its log."""
        if self.process is not None:
            if self.process.returncode is None:
                self.process.kill()
            with trio.move_on_after(10):
                await self.process.wait()
            if self.process.stdout is not None:
                await self.process.stdout.aclose()
        self._stderr.close()


async def _call(transport, tracker_addr: str, **body) -> swarm_pb2.TrackerReply:
    request = swarm_pb2.TrackerRequest(schema_version=1, **body)
    raw = await transport.request(
        peer_id_from_multiaddr(tracker_addr), [tracker_addr], TRACKER_PROTOCOL, request.SerializeToString(),
        timeout_s=REQUEST_TIMEOUT_S,
    )  # fmt: skip
    reply = swarm_pb2.TrackerReply()
    reply.ParseFromString(raw)
    return reply


def _wall_ms() -> int:
    return int(time.time() * 1000)


async def _check_metadata(transport, addr: str, model_path: Path, sha: str) -> None:
    reply = await _call(transport, addr, model_metadata={"model": "qwen2-tiny"})
    assert reply.WhichOneof("body") == "model_metadata", reply.error
    meta = reply.model_metadata
    assert (meta.model_sha256, meta.alias, meta.n_layer, meta.context_length) == (sha, "qwen2-tiny", 6, 2048)
    assert meta.size_bytes == model_path.stat().st_size
    # the file's first bytes, up to the tensor data (exactly: tests/test_tracker.py)
    with open(model_path, "rb") as f:
        assert len(meta.metadata) > 1000 and f.read(len(meta.metadata) + 1)[:-1] == meta.metadata


async def test_tracker_process_survives_kill_and_restart(tmp_path, qwen2_tiny_path):
    node_key = Ed25519PrivateKey.from_private_bytes(b"\x11" * 32)
    node_peer = peer_id_from_public_key(public_key_bytes(node_key))
    pin, patch_hash = expected_pin()
    first = TrackerProcess(tmp_path, ["--register-model", f"{qwen2_tiny_path}:qwen2-tiny"], "/ip4/127.0.0.1/tcp/0")
    second = None
    try:
        addr = await first.start()
        tracker_peer = peer_id_from_multiaddr(addr)
        port = addr.split("/tcp/")[1].split("/")[0]
        async with open_p2p_transport(node_key) as transport:
            listed = (await _call(transport, addr, list_models={})).list_models.models
            assert [(m.alias, m.architecture, m.n_layer) for m in listed] == [("qwen2-tiny", "qwen2", 6)]
            sha = listed[0].sha256
            fingerprint = swarm_pb2.Fingerprint(
                schema_version=1, peer_id=node_peer, llama_cpp_commit=pin, patch_series_sha256=patch_hash,
                created_at_ms=_wall_ms(), nonce=os.urandom(16), usable_memory_bytes=1 << 30,
                devices=[swarm_pb2.Device(backend="CPU", name="CPU")], decode_s_per_block=0.001,
                listen_addrs=transport.listen_addrs, model_sha256s=[sha],
            )  # fmt: skip
            reply = await _call(
                transport, addr, register=swarm_pb2.RegisterRequest(fingerprint=sign_fingerprint(node_key, fingerprint))
            )
            assert reply.WhichOneof("body") == "register", reply.error
            assert peer_id_from_public_key(reply.register.tracker_public_key) == tracker_peer
            beat = await _call(transport, addr, heartbeat=swarm_pb2.HeartbeatRequest(peer_id=node_peer))
            assert [(d.kind, d.assignment.begin, d.assignment.end) for d in beat.heartbeat.directives] == [
                (swarm_pb2.Directive.LOAD, 0, 6)
            ]
            [node] = (await _call(transport, addr, list_nodes={})).list_nodes.nodes
            assert (node.peer_id, node.alive, node.pending, list(node.serving)) == (node_peer, True, False, [])
            assert [(a.model_sha256, a.begin, a.end) for a in node.assigned] == [(sha, 0, 6)]
            assert list(node.listen_addrs) == list(transport.listen_addrs)
            await _check_metadata(transport, addr, qwen2_tiny_path, sha)

        assert await first.stop(signal.SIGKILL) == -signal.SIGKILL

        second = TrackerProcess(tmp_path, [], f"/ip4/127.0.0.1/tcp/{port}")
        assert await second.start() == addr  # same key, same port: same multiaddr
        async with open_p2p_transport(node_key) as transport:
            listed = (await _call(transport, addr, list_models={})).list_models.models
            assert [(m.alias, m.sha256) for m in listed] == [("qwen2-tiny", sha)]
            [node] = (await _call(transport, addr, list_nodes={})).list_nodes.nodes
            assert (node.peer_id, node.alive, node.pending) == (node_peer, False, True)
            await _check_metadata(transport, addr, qwen2_tiny_path, sha)  # the file's path survived
            # the node is still known (no "register first") and still assigned the model
            beat = await _call(transport, addr, heartbeat=swarm_pb2.HeartbeatRequest(peer_id=node_peer))
            assert beat.WhichOneof("body") == "heartbeat", beat.error
            assert [(d.kind, d.assignment.begin, d.assignment.end) for d in beat.heartbeat.directives] == [
                (swarm_pb2.Directive.LOAD, 0, 6)
            ]
            # and its nonce is remembered: the same registration is a replay
            reply = await _call(
                transport, addr, register=swarm_pb2.RegisterRequest(fingerprint=sign_fingerprint(node_key, fingerprint))
            )
            assert reply.error.message.startswith("replayed registration"), reply.error

        assert await second.stop(signal.SIGTERM) == 0
        with trio.fail_after(60):
            models = await trio.run_process(
                [sys.executable, "-m", "agent.io.tracker.cli", "models", "--db", str(tmp_path / "tracker.db")],
                cwd=REPO_ROOT, capture_stdout=True, check=True,
            )  # fmt: skip
        lines = models.stdout.decode().splitlines()
        assert lines[0].split() == ["ALIAS", "NAME", "HF", "REPO", "SHA256", "ARCHITECTURE", "BLOCKS", "SIZE"]
        assert lines[1].startswith("qwen2-tiny") and sha[:12] in lines[1] and " qwen2 " in lines[1]
        with trio.fail_after(60):
            nodes = await trio.run_process(
                [sys.executable, "-m", "agent.io.tracker.cli", "nodes", "--db", str(tmp_path / "tracker.db")],
                cwd=REPO_ROOT, capture_stdout=True, check=True,
            )  # fmt: skip
        lines = nodes.stdout.decode().splitlines()
        assert lines[0].split()[:3] == ["PEER", "ID", "ALIVE"] and len(lines) == 2
        assert lines[1].startswith(node_peer + "  yes") and lines[1].endswith("qwen2-tiny[0, 6) -")
    finally:
        with trio.CancelScope(shield=True):
            await first.close()
            if second is not None:
                await second.close()
