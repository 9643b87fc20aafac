"""The tracker's admissions (a part of ``agent.io.tracker.service.Tracker``): nodes' registrations
and clients' hellos, checked by the pure rules (``agent.core.wire.admission``), the cost of a new
identity (an invite and a proof of work where the operator asks for them,
``agent.core.wire.invites`` and ``agent.core.wire.admission_work``, and at most
``--new-identities-per-address-per-hour`` from one address), and the admissions the tracker signs.

Must not import ``agent.io.tracker.service`` (which imports this module).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.tracker import state as ev
from agent.core.wire import admission
from agent.core.wire.address_rate import NewIdentityRate
from agent.core.wire.admission_work import work_ok
from agent.core.wire.invites import invite_refusal, invite_sha256
from agent.io.net.transport import remote_host
from agent.io.tracker.config import TrackerConfig
from agent.io.tracker.refusal import Refusal
from agent.io.tracker.store import NodeRecord, TrackerStore

__all__ = ["Admissions", "node_facts"]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error


class Admissions:
    """Registrations, client hellos and the admissions the tracker signs."""

    # the Tracker's, set in its __init__
    store: TrackerStore
    config: TrackerConfig
    peer_id: str
    public_key: bytes
    new_identities: NewIdentityRate
    _key: Ed25519PrivateKey
    _now_ms: Callable[[], int]

    if TYPE_CHECKING:  # the Tracker's method this mixin calls

        def _apply(self, event: ev.Event) -> list[ev.Effect]: ...

    def _policy(self) -> admission.AdmissionPolicy:
        sizes = [m.bytes_per_block for m in self.store.models() if m.bytes_per_block > 0]
        return admission.AdmissionPolicy(
            llama_cpp_commit=self.config.llama_cpp_commit,
            patch_series_sha256=self.config.patch_series_sha256,
            registration_max_age_ms=self.config.registration_max_age_ms,
            min_bytes_per_block=min(sizes) if sizes else None,
        )

    def _issue(
        self, peer_id: str, role: swarm_pb2.Role, now: int, fingerprint_sha256: str = ""
    ) -> swarm_pb2.SignedAdmission:
        record = swarm_pb2.AdmissionRecord(
            schema_version=admission.ADMISSION_SCHEMA_VERSION,
            peer_id=peer_id,
            role=role,
            tracker_peer_id=self.peer_id,
            issued_at_ms=now,
            expires_at_ms=now + self.config.admission_ttl_ms,
            fingerprint_sha256=fingerprint_sha256,
        )
        return admission.issue_admission(self._key, record)

    def _register(self, remote: str, request: swarm_pb2.RegisterRequest) -> swarm_pb2.RegisterReply:
        if not request.HasField("fingerprint"):
            raise Refusal(Code.INVALID_ARGUMENT, "RegisterRequest has no fingerprint")
        signed = request.fingerprint
        try:
            fingerprint = admission.verify_signed_fingerprint(signed, remote)
        except admission.AdmissionError as error:
            raise Refusal(Code.REFUSED, error.reason) from None
        refused = self.store.refused(remote)
        if refused:
            log.info("refused node %s again: %s", remote, refused)
            raise Refusal(Code.REFUSED, refused)
        now = self._now_ms()
        new_identity = self.store.node(remote) is None
        if new_identity:
            self._check_new_identity(now, bytes(signed.public_key), request.work, request.invite)
        seen = self.store.nonce_seen(remote, fingerprint.nonce)
        decision = admission.decide_admission(fingerprint, self._policy(), now, seen)
        if len(fingerprint.nonce) == admission.NONCE_BYTES:
            self.store.add_nonce(remote, fingerprint.nonce, now)
        if not decision.admitted:
            log.info("refused node %s: %s", remote, decision.reason)
            raise Refusal(Code.REFUSED, decision.reason)
        if new_identity:
            self._admit_new_identity(now, request.invite)
        signed_admission = self._issue(remote, swarm_pb2.ROLE_NODE, now, admission.fingerprint_sha256(signed))
        self.store.put_node(
            NodeRecord(
                peer_id=remote,
                public_key=bytes(signed.public_key),
                signed_fingerprint=signed,
                fingerprint=fingerprint,
                admission=signed_admission,
                admitted_at_ms=now,
                expires_at_ms=now + self.config.admission_ttl_ms,
                last_heartbeat_ms=now,
                alive=True,
                listen_addrs=tuple(fingerprint.listen_addrs),
            )
        )
        # a (re-)registering node has nothing loaded yet, and its past failures are forgiven
        self._apply(ev.Registered(node_facts(remote, fingerprint), tuple(fingerprint.listen_addrs), remote_host()))
        return swarm_pb2.RegisterReply(
            admission=signed_admission,
            tracker_public_key=self.public_key,
            heartbeat_interval_ms=self.config.heartbeat_interval_ms,
            heartbeat_timeout_ms=self.config.heartbeat_timeout_ms,
        )

    def _client_hello(self, remote: str, hello: swarm_pb2.ClientHelloRequest) -> swarm_pb2.ClientHelloReply:
        try:
            admission.verify_client_hello(hello, remote)
        except admission.AdmissionError as error:
            raise Refusal(Code.REFUSED, error.reason) from None
        now = self._now_ms()
        new_identity = self.store.client_admission(remote) is None
        if new_identity:
            self._check_new_identity(now, bytes(hello.public_key), hello.work, hello.invite)
        decision = admission.decide_client_admission(
            hello, self._policy(), now, self.store.nonce_seen(remote, hello.nonce)
        )
        if len(hello.nonce) == admission.NONCE_BYTES:
            self.store.add_nonce(remote, hello.nonce, now)
        if not decision.admitted:
            raise Refusal(Code.REFUSED, decision.reason)
        if new_identity:
            self._admit_new_identity(now, hello.invite)
        signed = self._issue(remote, swarm_pb2.ROLE_CLIENT, now)
        self.store.put_client(remote, bytes(hello.public_key), signed, now, now + self.config.admission_ttl_ms)
        return swarm_pb2.ClientHelloReply(admission=signed, tracker_public_key=self.public_key)

    def _check_new_identity(self, now: int, public_key: bytes, work: bytes, invite: str) -> None:
        """Refuse a new identity without its invite or its proof of work (where asked), or from an
        address that brought its hour's worth already."""
        if self.config.require_invites:
            why = invite_refusal(invite, self.store.invite, now)
            if why:
                log.info("refused a new identity from %s: %s", remote_host(), why)
                raise Refusal(Code.REFUSED, why)
        if not work_ok(public_key, work, bits := self.config.admission_work_bits):
            raise Refusal(Code.REFUSED, f"a new identity needs a proof of work of {bits} bits", work_bits=bits)
        host = remote_host()
        wait_ms = self.new_identities.retry_after_ms(host, now)
        if wait_ms:
            log.info("refused a new identity from %s: its hour's %d are taken", host, self.new_identities.per_window)
            raise Refusal(
                Code.RESOURCE_EXHAUSTED,
                f"{self.new_identities.per_window} new identities from {host} this hour already: try again in"
                f" {wait_ms / 1000:.0f} s, or reuse a key",
            )

    def _admit_new_identity(self, now: int, invite: str) -> None:
        """A new identity admitted: counted against its address, and one use of its invite taken
        (checked by ``_check_new_identity`` in the same request, with nothing awaited between)."""
        self.new_identities.note(remote_host(), now)
        if self.config.require_invites:
            self.store.use_invite(invite_sha256(invite))


def node_facts(peer_id: str, fingerprint: swarm_pb2.Fingerprint) -> ev.NodeFacts:
    """The facts of a node the reducer decides on, from its fingerprint."""
    return ev.NodeFacts(
        peer_id,
        fingerprint.usable_memory_bytes,
        fingerprint.decode_s_per_block,
        frozenset(fingerprint.model_sha256s),
        fingerprint.fetches_models,
    )
