"""The tracker's part in output integrity (docs/INTEGRITY.md): ``OutputIntegrity``, mixed into
``agent.io.tracker.service.Tracker``.

With ``TrackerConfig.canary`` the tracker runs its verifier (``agent.io.tracker.verifier``)
and keeps the ``CanarySchedule`` it follows, synced with the READY ranges of every heartbeat;
a READY range is routed once it passed a check (the gate); ``record_check`` acts on each
outcome: a failure withdraws the range at once (not assigned to that node again until it
registers anew), the ``refuse_after_failures``-th refuses the node (marked dead, its
registrations refused: kept in the store). ``integrity`` tells owners which peers failed
lately; ``report_mismatch`` (an owner's spot check) makes the peers in which two routes differ
the next to be checked. Decisions are the pure core's (``agent.core.tracker.canary``).

Owns the integrity state (``_init_integrity``: the schedule, last passes, the verifier's
totals) and what acts on it; withdrawn ranges and refused nodes are the tracker's reducer's
(``agent.core.tracker.reducer``: ``RangeWithdrawn``, ``NodeRefused``), fed through the
``Tracker``'s ``_apply``; the rest (store, liveness, assignments) is the ``Tracker``'s,
declared below as what this mixin uses of it.

Must not import ``agent.io.tracker.service`` (which imports this module).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import trio

from agent._proto import swarm_pb2
from agent.core.tracker import state as ev
from agent.core.tracker.assignment import Assignment
from agent.core.tracker.canary import CanaryPolicy, CanarySchedule, FailureAction, RangeKey, after_failure
from agent.io.tracker.config import TrackerConfig
from agent.io.tracker.model_files import ModelFiles
from agent.io.tracker.refusal import Refusal
from agent.io.tracker.store import TrackerStore
from agent.io.tracker.verifier_api import CheckOutcome, VerifierStats

__all__ = ["OutputIntegrity"]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error
State = swarm_pb2.AssignmentStatus
#: the most peers one integrity request may ask about (a route has a few hops)
_MAX_INTEGRITY_PEERS = 64


class OutputIntegrity:
    """Canary checks' outcomes, withdrawn ranges and the integrity requests of owners; the
    ``CanaryHost`` the verifier uses (with ``Tracker.changed``)."""

    # the Tracker's, set in its __init__
    store: TrackerStore
    config: TrackerConfig
    model_files: ModelFiles
    _now_ms: Callable[[], int]

    if TYPE_CHECKING:  # the Tracker's methods this mixin calls

        @property
        def alive(self) -> set[str]: ...
        def _notify(self) -> None: ...
        def _apply(self, event: ev.Event) -> list[ev.Effect]: ...
        def _issue(
            self, peer_id: str, role: swarm_pb2.Role, now: int, fingerprint_sha256: str = ""
        ) -> swarm_pb2.SignedAdmission: ...

    def _init_integrity(self, policy: CanaryPolicy | None) -> None:
        #: canary checks (None when off): which READY range is checked when, which passed
        self.canary_policy = policy
        self.canaries = CanarySchedule(policy) if policy is not None else None
        self._canary_rng = np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
        #: (peer id, model sha256) -> when (tracker clock) a range of it last passed a check: a
        #: failure of that model before then is no longer named to owners (the node registered
        #: anew and was checked since; a pass of another model clears nothing)
        self._last_pass_ms: dict[tuple[str, str], int] = {}
        #: the verifier's totals (checks passed, failed, inconclusive; rows; time)
        self.verifier_stats = VerifierStats()

    def _cleared(self, key: RangeKey) -> bool:
        """Whether the range may be routed as far as checks go: checks off or not gating, or
        it passed one since it became READY."""
        if self.canaries is None or self.canary_policy is None or not self.canary_policy.gate_new_ranges:
            return True
        return self.canaries.cleared(key)

    def issue_persona_admission(self, peer_id: str, role: swarm_pb2.Role) -> swarm_pb2.SignedAdmission:
        """An admission for one of the verifier's fresh identities, as nodes and clients get
        theirs (a node's names a fingerprint digest: a random one, as a real one looks)."""
        digest = hashlib.sha256(os.urandom(32)).hexdigest() if role == swarm_pb2.ROLE_NODE else ""
        return self._issue(peer_id, role, self._now_ms(), digest)

    async def canary_target(self, key: RangeKey) -> tuple[tuple[str, ...], str, int, str]:
        """What a check of ``key`` needs: the node's addresses, the range's recipe hash as it
        reported it, the model's block count and the registered file (its size and sha256
        checked once: ``ModelFiles.file_facts``).

        Raises:
          LookupError: the range is no longer READY on a live node, or the file is unusable.
        """
        peer_id, model_sha256, begin, end = key
        node = self.store.node(peer_id)
        model = self.store.find_model(model_sha256)
        rows = [
            row for row in self.store.assignments()
            if row.assignment == Assignment(model_sha256, begin, end, peer_id) and row.state == State.READY
        ]  # fmt: skip
        if node is None or model is None or not rows or peer_id not in self.alive:
            raise LookupError("the range is no longer served")
        try:
            await self.model_files.file_facts(model)
        except Refusal as refusal:
            raise LookupError(refusal.message) from None
        path = self.store.model_path(model_sha256)
        assert path is not None  # file_facts refuses a model without a file
        return node.listen_addrs, rows[0].recipe_hash, model.n_layer, str(path)

    def record_check(self, outcome: CheckOutcome) -> FailureAction | None:
        """Act on a check's outcome: a pass counts (and may open the range to routes); a
        failure records the evidence and withdraws the range at once, or refuses the node
        (``CanaryPolicy.refuse_after_failures``); inconclusive tries again later."""
        assert self.canaries is not None and self.canary_policy is not None
        self.verifier_stats.add(outcome)
        key = outcome.key
        peer_id, model_sha256, begin, end = key
        now_s = trio.current_time()
        if outcome.status == "passed":
            self.store.add_check_passed(peer_id)
            self._last_pass_ms[(peer_id, model_sha256)] = self._now_ms()
            self.canaries.passed(key, now_s, self._canary_rng)
            self._apply(ev.NodeProven(peer_id))  # gaps go to it before nodes never checked
            self._notify()
            return None
        if outcome.status != "failed":
            self.canaries.inconclusive(key, now_s)
            self._notify()
            return None
        mismatch = outcome.mismatch
        assert mismatch is not None
        failure = swarm_pb2.IntegrityFailure(
            check_id=outcome.check_id, assignment=swarm_pb2.Assignment(model_sha256=model_sha256, begin=begin, end=end),
            step=mismatch.step, output=mismatch.output, expected_sha256=mismatch.expected_sha256,
            returned_sha256=mismatch.returned_sha256, max_abs_diff=mismatch.max_abs_diff, at_ms=self._now_ms(),
            detail=mismatch.detail,
        )  # fmt: skip
        failures = self.store.add_integrity_failure(peer_id, failure)
        self.canaries.failed(key)
        action = after_failure(self.canary_policy, failures)
        log.warning(
            "node %s FAILED %s of model %s blocks [%d, %d) at step %d: %s differ (expected sha256 %s, returned %s; %s): %s",
            peer_id, outcome.check_id, model_sha256[:12], begin, end, mismatch.step, mismatch.output,
            mismatch.expected_sha256[:16], mismatch.returned_sha256[:16], mismatch.detail,
            "refused" if action is FailureAction.REFUSE else "range withdrawn",
        )  # fmt: skip
        if action is FailureAction.REFUSE:
            self.store.refuse_node(
                peer_id,
                f"refused: the output of this node failed {failures} integrity checks (the last: {outcome.check_id}, "
                f"model {model_sha256[:12]} blocks [{begin}, {end}), step {mismatch.step}: {mismatch.output} differ)",
            )
            self._apply(ev.NodeRefused(peer_id, failures))
        else:
            self.canaries.prioritise(peer_id, None, now_s)  # whatever else it serves is checked next
            self._apply(ev.RangeWithdrawn(peer_id, model_sha256))  # not assigned nor routed: recomputed
        return action

    def _withdrawn_reason(self, peer_id: str) -> swarm_pb2.WithdrawnPeer | None:
        """Why owners should not trust what ``peer_id`` computed lately: it is refused, or it
        failed a check (within ``integrity_memory_ms``) and passed none of that model since;
        else None."""
        refused = self.store.refused(peer_id)
        recent = [
            f for f in self.store.integrity_failures(peer_id, since_ms=self._now_ms() - self.config.integrity_memory_ms)
            if f.at_ms >= self._last_pass_ms.get((peer_id, f.assignment.model_sha256), -1)
        ]  # fmt: skip
        if not refused and not recent:
            return None
        last = recent[-1] if recent else None
        reason = refused or (
            f"failed {last.check_id} (blocks [{last.assignment.begin}, {last.assignment.end}), step {last.step})"
            if last is not None else "failed an integrity check"
        )  # fmt: skip
        return swarm_pb2.WithdrawnPeer(peer_id=peer_id, failed_at_ms=last.at_ms if last else 0, reason=reason)

    def _integrity(self, request: swarm_pb2.IntegrityRequest) -> swarm_pb2.IntegrityReply:
        if len(request.peer_ids) > _MAX_INTEGRITY_PEERS:
            raise Refusal(
                Code.INVALID_ARGUMENT, f"{len(request.peer_ids)} peer ids asked about, at most {_MAX_INTEGRITY_PEERS}"
            )
        withdrawn = [w for w in map(self._withdrawn_reason, dict.fromkeys(request.peer_ids)) if w is not None]
        return swarm_pb2.IntegrityReply(withdrawn=withdrawn)

    def _report_mismatch(self, remote: str, report: swarm_pb2.ReportMismatchRequest) -> swarm_pb2.ReportMismatchReply:
        """An owner's spot check disagreed: check the peers in which the two routes differ
        next (a report withdraws nobody). Only admitted clients may report."""
        signed = self.store.client_admission(remote)
        if signed is None or swarm_pb2.AdmissionRecord.FromString(signed.record).expires_at_ms <= self._now_ms():
            raise Refusal(Code.REFUSED, "only an admitted session owner may report a mismatch")
        if len(report.route) + len(report.shadow) > 2 * _MAX_INTEGRITY_PEERS:
            raise Refusal(Code.INVALID_ARGUMENT, "the routes of the report have too many hops")
        if self.canaries is None:
            return swarm_pb2.ReportMismatchReply()
        route = {hop.peer_id for hop in report.route}
        shadow = {hop.peer_id for hop in report.shadow}
        suspects = sorted(route ^ shadow)
        log.warning(
            "owner %s: a spot check of model %s disagreed at step %d (route %s, shadow %s): checking %s",
            remote, report.model_sha256[:12], report.step, report.route_sha256[:16], report.shadow_sha256[:16],
            ", ".join(suspects) or "nobody (the routes do not differ)",
        )  # fmt: skip
        now_s = trio.current_time()
        scheduled = sum(len(self.canaries.prioritise(peer, report.model_sha256 or None, now_s)) for peer in suspects)
        if scheduled:
            self._notify()
        return swarm_pb2.ReportMismatchReply(checks_scheduled=scheduled)
