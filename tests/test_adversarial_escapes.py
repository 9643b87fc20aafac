"""An attack on a running tracker, made as an attacker would: a node of its own key sends terminal
escapes and newlines in the strings the tracker keeps and shows (a listen address, a heartbeat's
``error``), to clear an operator's screen or forge lines in the tracker's log.

Real processes on loopback: a tracker, and ``baton tracker nodes`` (the real CLI) reading its
database. Addresses that are not printable multiaddrs are refused with the reason (in a
registration and in a heartbeat); a failed range's error text is logged escaped; neither the
CLI's output nor the tracker's log carries an escape, a carriage return, a bidi override or a
forged line raw.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.net.multiaddrs import peer_id_from_multiaddr
from agent.core.wire.admission import sign_fingerprint
from agent.core.wire.swarm_wire import SCHEMA_VERSION, TRACKER_PROTOCOL
from agent.harness.local_swarm import LocalSwarmConfig, open_local_swarm
from agent.io.keys import peer_id_of
from agent.io.net.p2p import open_p2p_transport
from agent.models import model_path
from agent.runtime import expected_pin

pytestmark = [pytest.mark.swarm, pytest.mark.adversarial]

FORGED = "2026-01-01 00:00:00,000 agent.io.tracker.service INFO all nodes healthy"
HOSTILE = f"\x1b[2J\x1b[H\x1b[31mworker crashed\r\n{FORGED}\u202e"


@pytest.mark.timeout(180)
async def test_node_strings_reach_neither_the_nodes_table_nor_the_log_raw() -> None:
    config = LocalSwarmConfig(model_path=model_path("smollm2"), model_alias="smollm2")
    async with open_local_swarm(config) as swarm:
        addr = await swarm.start_tracker()
        assert swarm.tracker is not None
        key = Ed25519PrivateKey.generate()
        peer_id = peer_id_of(key)
        pin, patch_hash = expected_pin()
        async with open_p2p_transport(key) as transport:

            async def call(**body) -> swarm_pb2.TrackerReply:
                request = swarm_pb2.TrackerRequest(schema_version=SCHEMA_VERSION, **body)
                raw = await transport.request(peer_id_from_multiaddr(addr), [addr], TRACKER_PROTOCOL,
                                              request.SerializeToString(), timeout_s=30)  # fmt: skip
                return swarm_pb2.TrackerReply.FromString(raw)

            (model,) = (await call(list_models={})).list_models.models

            def registration(listen_addrs: list[str]) -> swarm_pb2.RegisterRequest:
                fingerprint = swarm_pb2.Fingerprint(
                    schema_version=1, peer_id=peer_id, llama_cpp_commit=pin, patch_series_sha256=patch_hash,
                    created_at_ms=int(time.time() * 1000), nonce=os.urandom(16), usable_memory_bytes=1 << 30,
                    devices=[swarm_pb2.Device(backend="CPU", name="CPU")], decode_s_per_block=0.001,
                    listen_addrs=listen_addrs, model_sha256s=[model.sha256],
                )  # fmt: skip
                return swarm_pb2.RegisterRequest(fingerprint=sign_fingerprint(key, fingerprint))

            hostile_addr = f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}{HOSTILE}"
            refused = await call(register=registration([hostile_addr]))
            assert refused.error.code == swarm_pb2.Error.REFUSED, refused
            assert "\x1b" not in refused.error.message and "listen_addrs[0]" in refused.error.message
            reply = await call(register=registration(list(transport.listen_addrs)))
            assert reply.WhichOneof("body") == "register", reply.error
            beat = await call(heartbeat=swarm_pb2.HeartbeatRequest(peer_id=peer_id, listen_addrs=[hostile_addr]))
            assert beat.error.code == swarm_pb2.Error.INVALID_ARGUMENT, beat
            (load,) = (await call(heartbeat=swarm_pb2.HeartbeatRequest(peer_id=peer_id))).heartbeat.directives
            failed = swarm_pb2.AssignmentStatus(
                assignment=load.assignment, state=swarm_pb2.AssignmentStatus.FAILED, error=HOSTILE
            )
            beat = await call(heartbeat=swarm_pb2.HeartbeatRequest(peer_id=peer_id, serving=[failed]))
            assert beat.WhichOneof("body") == "heartbeat", beat.error

        with trio.fail_after(60):
            nodes = await trio.run_process(
                [sys.executable, "-m", "agent.cli", "tracker", "nodes", "--db", str(swarm.db_path)],
                capture_stdout=True, stderr=subprocess.STDOUT, check=True,
            )  # fmt: skip
        table = nodes.stdout.decode()
        assert peer_id in table
        log = swarm.tracker.log_tail(1 << 20)
        assert "worker crashed" in log  # the error is logged, escaped
        for name, text in (("baton tracker nodes", table), ("the tracker's log", log)):
            for raw in ("\x1b", "\r", "\u202e"):
                assert raw not in text, f"{name} shows {raw!r} raw:\n{text}"
            assert not any(line.startswith(FORGED) for line in text.splitlines()), f"{name} has a forged line"
        assert "\\x1b[2J\\x1b[H\\x1b[31mworker crashed\\r\\n" in log
