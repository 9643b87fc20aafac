"""The owner's integrity shell: spot checks of its own sessions and the tracker's word on peers.

Owns the I/O of ``agent.core.owner.spot_check``'s decisions for a ``SwarmClient``:
- ``SpotChecks.watch(model, route)``: around one session; for a sampled one
  (``SwarmClientConfig.spot_check_rate``) a *shadow* session replays each step the session
  completed (the same rows, fed as their results arrive) through a route of the same recipe
  that avoids one of its hops, one step behind, and compares each result bit for bit. A
  disagreement is reported to the tracker (``report_mismatch``), which checks the peers in
  which the two routes differ with its canaries. The shadow never changes the generation: its
  failures (no other route, a hop that refuses or is slow) end the shadow alone, counted as
  inconclusive; it is dropped at once when the session fails, and waited for at most
  ``spot_check_grace_s`` when the session ends;
- ``withdrawn_peers``: which of a set of peers the tracker says failed an integrity check
  (``integrity``), within ``integrity_timeout_s``; best effort (a tracker that cannot be
  reached says nobody).

Costs (``SpotCheckStats``): a checked session's steps run twice, on other nodes; the rows of
shadow steps are counted so that the share of the swarm's work they take can be measured
(bench/integrity.py).

Must not import the client's layers (``agent.io.client.steps`` and those above it, which import
this module): what the checks use of their client is ``SpotCheckClient``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Protocol

import numpy as np
import trio

from agent._proto import swarm_pb2
from agent.core.owner.spot_check import compare_results, hop_to_avoid, result_digest, sample, shadow_request
from agent.core.wire.swarm_wire import SESSION_ID_BYTES, STEP_PROTOCOL
from agent.io.net.transport import Transport, TransportError

__all__ = ["ResultTaker", "SpotCheckClient", "SpotCheckStats", "SpotCheckTimeouts", "SpotChecks", "withdrawn_peers"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SpotCheckStats:
    """What the owner's spot checks did: sessions checked, steps and rows replayed, results
    that agreed, mismatches found, shadows that could not conclude (with the last reason)."""

    sessions: int = 0
    steps: int = 0
    rows: int = 0
    agreed: int = 0
    mismatches: int = 0
    inconclusive: int = 0
    last_inconclusive: str = ""
    reports: list[swarm_pb2.ReportMismatchRequest] = dataclasses.field(default_factory=list)


class ResultTaker(Protocol):
    """Where the client's result handler hands the results pushed for one session."""

    def deliver(self, remote_peer_id: str, result: swarm_pb2.StepResult) -> swarm_pb2.Error | None:
        """Take ``result`` from ``remote_peer_id``; the error to acknowledge with, or None."""
        ...


class SpotCheckTimeouts(Protocol):
    """The client's deadlines the spot checks keep to (``SwarmClientConfig``'s)."""

    @property
    def request_timeout_s(self) -> float: ...
    @property
    def step_timeout_s(self) -> float: ...
    @property
    def integrity_timeout_s(self) -> float: ...


class SpotCheckClient(Protocol):
    """What the spot checks use of their client (``agent.io.client.swarm.SwarmClient``, which
    imports this module: it is not imported here)."""

    @property
    def config(self) -> SpotCheckTimeouts: ...
    @property
    def transport(self) -> Transport: ...

    async def route(self, model: str, *, avoid_peers: Sequence[str] = ()) -> swarm_pb2.Route: ...
    async def end_session(self, route: swarm_pb2.Route, session_id: bytes) -> object: ...
    async def report_mismatch(self, report: swarm_pb2.ReportMismatchRequest) -> object: ...
    async def integrity(self, peer_ids: Sequence[str]) -> swarm_pb2.IntegrityReply: ...

    def take_results(self, session_id: bytes, taker: ResultTaker) -> None:
        """From now on the results pushed for ``session_id`` go to ``taker``."""
        ...

    def stop_taking_results(self, session_id: bytes) -> None:
        """Results for ``session_id`` are refused again (an unknown session)."""
        ...


class _Inconclusive(Exception):
    pass


class _ShadowLive:
    """The shadow session's entry in the client's live sessions: takes its results."""

    def __init__(self, peers: list[str]) -> None:
        self.peers = peers
        self.step = -1
        self.arrived = trio.Event()
        self.result: swarm_pb2.StepResult | None = None

    def expect(self, step: int) -> None:
        self.step, self.arrived, self.result = step, trio.Event(), None

    def deliver(self, remote_peer_id: str, result: swarm_pb2.StepResult) -> swarm_pb2.Error | None:
        failed = result.error.code != swarm_pb2.Error.CODE_UNSPECIFIED
        if remote_peer_id not in self.peers or (not failed and remote_peer_id != self.peers[-1]):
            return swarm_pb2.Error(
                code=swarm_pb2.Error.REFUSED, message=f"{remote_peer_id} is not the shadow's last hop"
            )
        if result.step != self.step or self.arrived.is_set():
            return swarm_pb2.Error(code=swarm_pb2.Error.INVALID_ARGUMENT, message=f"unexpected step {result.step}")
        self.result = result
        self.arrived.set()
        return None


class _Shadow:
    """One spot check: the steps of the watched session, replayed in order."""

    def __init__(self, checks: SpotChecks, model: str, route: swarm_pb2.Route) -> None:
        self.checks = checks
        self.model = model
        self.route = route
        self.send, self.receive = trio.open_memory_channel[tuple[swarm_pb2.StepRequest, swarm_pb2.StepResult]](math.inf)
        self.done = trio.Event()

    def feed(self, request: swarm_pb2.StepRequest, result: swarm_pb2.StepResult) -> None:
        """A step of the watched session completed with ``result`` (called by the client)."""
        self.send.send_nowait((request, result))

    async def run(self) -> None:
        stats = self.checks.stats
        try:
            await self._replay()
        except _Inconclusive as why:
            stats.inconclusive += 1
            stats.last_inconclusive = str(why)
            log.info("spot check inconclusive: %s", why)
        except Exception as err:  # a shadow must never take the generation down
            stats.inconclusive += 1
            stats.last_inconclusive = f"{type(err).__name__}: {err}"
            log.exception("spot check failed")
        finally:
            self.done.set()

    async def _replay(self) -> None:
        client, stats = self.checks.client, self.checks.stats
        avoid = hop_to_avoid(self.route, self.checks.rng)
        try:
            shadow = await client.route(self.model, avoid_peers=[avoid])
        except Exception as err:  # SwarmError / TransportError: no second copy now
            raise _Inconclusive(f"no route around {avoid}: {err}") from None
        if shadow.recipe_hash != self.route.recipe_hash or shadow.model_sha256 != self.route.model_sha256:
            raise _Inconclusive("the only other route is of another recipe")
        session_id = os.urandom(SESSION_ID_BYTES)
        live = _ShadowLive([hop.peer_id for hop in shadow.hops])
        client.take_results(session_id, live)
        stats.sessions += 1
        first = shadow.hops[0]
        sent = False
        try:
            async for original_request, original_result in self.receive:
                request = shadow_request(original_request, session_id, shadow)
                live.expect(request.step)
                try:
                    raw = await client.transport.request(
                        first.peer_id, list(first.addrs), STEP_PROTOCOL, request.SerializeToString(),
                        timeout_s=client.config.request_timeout_s,
                    )  # fmt: skip
                except TransportError as err:
                    raise _Inconclusive(f"the shadow's first hop: {err}") from None
                sent = True
                ack = swarm_pb2.StepAck.FromString(raw)
                if ack.error.code:
                    raise _Inconclusive(f"the shadow's first hop refused step {request.step}: {ack.error.message}")
                with trio.move_on_after(client.config.step_timeout_s):
                    await live.arrived.wait()
                result = live.result
                if result is None:
                    raise _Inconclusive(f"no shadow result for step {request.step}")
                if result.error.code:
                    raise _Inconclusive(f"the shadow failed at step {request.step}: {result.error.message}")
                stats.steps += 1
                stats.rows += len(request.positions)
                try:
                    mismatch = compare_results(request.step, original_result, result)
                except ValueError as err:
                    raise _Inconclusive(f"a malformed result at step {request.step}: {err}") from None
                if mismatch is None:
                    stats.agreed += 1
                    continue
                stats.mismatches += 1
                await self._report(shadow, request.step, original_result, result)
                return
        finally:
            client.stop_taking_results(session_id)
            if sent:
                with trio.CancelScope(shield=True), trio.move_on_after(client.config.request_timeout_s):
                    with contextlib.suppress(Exception):
                        await client.end_session(shadow, session_id)

    async def _report(
        self, shadow: swarm_pb2.Route, step: int, original: swarm_pb2.StepResult, other: swarm_pb2.StepResult
    ) -> None:
        report = swarm_pb2.ReportMismatchRequest(
            model_sha256=self.route.model_sha256, route=list(self.route.hops), shadow=list(shadow.hops), step=step,
            route_sha256=result_digest(original), shadow_sha256=result_digest(other),
        )  # fmt: skip
        self.checks.stats.reports.append(report)
        log.warning(
            "spot check: step %d differs between route %s and route %s (sha256 %s vs %s): reporting it",
            step, [h.peer_id for h in self.route.hops], [h.peer_id for h in shadow.hops],
            report.route_sha256[:16], report.shadow_sha256[:16],
        )  # fmt: skip
        with contextlib.suppress(Exception):  # best effort: the tracker may be down
            await self.checks.client.report_mismatch(report)


class SpotChecks:
    """The spot checks of one ``SwarmClient`` (its ``spot_checks``)."""

    def __init__(
        self, client: SpotCheckClient, rate: float, grace_s: float, rng: np.random.Generator | None = None
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"spot_check_rate must be in [0, 1], got {rate}")
        self.client = client
        self.rate = rate
        self.grace_s = grace_s
        self.rng = rng or np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
        self.stats = SpotCheckStats()

    @contextlib.asynccontextmanager
    async def watch(self, model: str, route: swarm_pb2.Route) -> AsyncIterator[_Shadow | None]:
        """Around one session on ``route``: yields the shadow to ``feed`` its completed steps
        (None when this session is not checked).

        Cancellation / errors: a failure (or cancellation) of the session drops the shadow at
        once and is raised as itself; a session that ends well waits for its shadow at most
        ``grace_s``."""
        if not sample(self.rate, self.rng):
            yield None
            return
        shadow = _Shadow(self, model, route)
        failure: BaseException | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(shadow.run)
            try:
                yield shadow
            except BaseException as error:  # raised below as itself, not inside the nursery's group
                failure = error
            else:
                shadow.send.close()
                with trio.move_on_after(self.grace_s):
                    await shadow.done.wait()
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure


async def withdrawn_peers(client: SpotCheckClient, peers: Iterable[str]) -> dict[str, str]:
    """peer id -> why, for those of ``peers`` the tracker says failed an integrity check
    lately (or refuses). Best effort: {} when the tracker cannot say within
    ``integrity_timeout_s`` (an older tracker, one that is down)."""
    asked = sorted(set(peers))
    if not asked:
        return {}
    with trio.move_on_after(client.config.integrity_timeout_s):
        try:
            reply = await client.integrity(asked)
        except Exception as err:  # SwarmError / TransportError
            log.info("could not ask the tracker about %s: %s", ", ".join(asked), err)
            return {}
        return {w.peer_id: w.reason for w in reply.withdrawn if w.peer_id in asked}
    log.info("the tracker did not say within %.1f s whether %s failed checks", client.config.integrity_timeout_s, asked)
    return {}
