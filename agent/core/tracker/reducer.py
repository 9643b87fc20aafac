"""The tracker as a reducer: ``apply(state, event, now_ms) -> (state, effects)``.

Owns every rule by which the tracker's live state changes (the records are
``agent.core.tracker.state``'s):
- a registration: the node's facts kept, its reported states, load failures and withdrawals
  forgotten, it is alive, the assignment recomputed;
- a heartbeat (``agent.core.tracker.heartbeat``: the report checked, newly failed models,
  the LOAD/UNLOAD diff): it keeps the node alive, a node not alive here comes back, its
  reported states are kept, and the reply is its directives;
- a sweep (``agent.core.tracker.liveness``): nodes past their deadline are dead, their
  states cleared, the assignment recomputed (healing: ``agent.core.tracker.assignment``);
  nonces pruned once per ``registration_max_age_ms``;
- suspects: an owner's report of a lost peer starts one probe per peer; a probe that is not
  answered marks the peer dead at once (routes avoid it long before its heartbeat deadline);
  a report alone removes nobody;
- withdrawal: a range that failed a canary check is not assigned to its node again (nor
  routed) until it registers anew; a refused node is dead;
- loading deadlines: a range not READY within ``TrackerRules.loading_base_ms`` plus its bytes
  at ``loading_min_bytes_per_s`` is taken back, as a failed load (a node reporting LOADING for
  ever holds nothing);
- proven nodes (a READY range, or a passed check where checks gate routes) get gaps first, and
  a node that comes back within ``former_memory_ms`` of its death gets its READY ranges back
  from nodes still loading them (a node that only claims memory cannot keep a range from the
  node that served it);
- routability (``ready_ranges``): the READY ranges, with a recipe, of alive nodes, not
  withdrawn and cleared by the canary gate, with their live sessions.

``apply`` never mutates its arguments: it returns a new state (the old one stays a valid
snapshot) and the effects the shell performs, in order (``agent.io.tracker.service``).

Pure: ``now_ms`` comes in. Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from agent._proto import swarm_pb2
from agent.core.net.multiaddrs import seen_first
from agent.core.tracker.assignment import Assignment, NodeCapacity, assign
from agent.core.tracker.heartbeat import diff_assignment, read_prefixes, read_report
from agent.core.tracker.liveness import Liveness
from agent.core.tracker.routing import ReadyRange
from agent.core.tracker.state import (
    ClearStatus,
    Directives,
    Effect,
    Event,
    ForgetChecks,
    Heartbeat,
    LoadFailed,
    Log,
    MarkDead,
    ModelsChanged,
    NodeFacts,
    NodeProven,
    NodeRefused,
    Notify,
    PeerReported,
    ProbeEnded,
    ProbePeer,
    PruneNonces,
    RangeStatus,
    RangeWithdrawn,
    Recompute,
    Refuse,
    Registered,
    ReportAnswered,
    StoreAssignments,
    StoreHeartbeat,
    StoreStatus,
    Sweep,
    SyncChecks,
    TrackerRules,
    TrackerState,
)
from agent.core.wire.swarm_wire import WireError, check_listen_addrs

__all__ = ["apply", "live_sessions", "loading_deadline_ms", "next_sweep_in_ms", "ready_ranges", "restore"]

Code = swarm_pb2.Error
State = swarm_pb2.AssignmentStatus
#: The most ``PeerPath`` entries kept of one heartbeat (a node talks to its route neighbours
#: and owners: a long list is kept only in part).
MAX_PEER_PATHS = 256
#: (peer id, model sha256, begin, end): one range served by one node.
RangeKey = tuple[str, str, int, int]
K = TypeVar("K")
V = TypeVar("V")


def restore(
    rules: TrackerRules,
    nodes: Iterable[NodeFacts],
    alive: Iterable[str],
    listen_addrs: Mapping[str, tuple[str, ...]],
    assignments: Mapping[Assignment, RangeStatus],
    now_ms: int,
) -> TrackerState:
    """The state of a tracker starting on its store: ``nodes`` every admitted node, ``alive``
    those the store holds alive (pending until heard), the stored assignment. Nonces are
    pruned at the first sweep."""
    return TrackerState(
        rules=rules,
        liveness=Liveness(rules.heartbeat_timeout_ms).restored(alive, now_ms),
        nodes={facts.peer_id: facts for facts in nodes},
        listen_addrs=dict(listen_addrs),
        assignments=dict(assignments),
        loading_since_ms={a: now_ms for a, status in assignments.items() if status.state != State.READY},
        pruned_at_ms=now_ms - rules.registration_max_age_ms,
    )


def apply(state: TrackerState, event: Event, now_ms: int) -> tuple[TrackerState, list[Effect]]:
    """The state after ``event`` at ``now_ms`` (the tracker's clock), and what the shell does."""
    effects: list[Effect] = []
    if isinstance(event, Heartbeat):
        state = _heartbeat(state, event, now_ms, effects)
    elif isinstance(event, Registered):
        state = _registered(state, event, now_ms, effects)
    elif isinstance(event, Sweep):
        state = _sweep(state, now_ms, effects)
    elif isinstance(event, PeerReported):
        state = _reported(state, event, effects)
    elif isinstance(event, ProbeEnded):
        state = dataclasses.replace(state, suspects=state.suspects - {event.peer_id})
        if event.answered is False and event.peer_id in state.liveness:
            why = f"{event.reporter} lost it ({event.reason[:200]}) and it does not answer a probe"
            state = _mark_dead(state, (event.peer_id,), why, now_ms, effects)
    elif isinstance(event, RangeWithdrawn):
        state = dataclasses.replace(
            state,
            withdrawn=state.withdrawn | {(event.peer_id, event.model_sha256)},
            proven=state.proven - {event.peer_id},
        )
        state = _recompute(state, now_ms, effects)
    elif isinstance(event, NodeRefused):
        state = dataclasses.replace(state, proven=state.proven - {event.peer_id})
        if event.peer_id in state.liveness:
            why = f"node failed {event.failures} integrity checks"
            state = _mark_dead(state, (event.peer_id,), why, now_ms, effects)
        else:
            effects.append(Notify())
    elif isinstance(event, NodeProven):
        if event.peer_id not in state.proven:
            state = dataclasses.replace(state, proven=state.proven | {event.peer_id})
    elif isinstance(event, ModelsChanged):
        models = tuple(m for m in event.models if m.n_layer > 0)
        state = dataclasses.replace(state, models=models, fetchable=event.fetchable)
    elif isinstance(event, Recompute):
        state = _recompute(state, now_ms, effects)
    else:  # pragma: no cover - the Event union is closed
        raise TypeError(f"not a tracker event: {event!r}")
    return state, effects


# --- queries ----------------------------------------------------------------------------------


def live_sessions(state: TrackerState) -> dict[RangeKey, tuple[int, int]]:
    """(peer, model, begin, end) -> (sequences in use, sequences) as each node last reported
    them in a heartbeat to this tracker."""
    return {
        (peer_id, s.assignment.model_sha256, s.assignment.begin, s.assignment.end): (
            s.sequences_in_use,
            s.sequences_total,
        )
        for peer_id, serving in state.serving.items()
        for s in serving
    }


def next_sweep_in_ms(state: TrackerState, now_ms: int) -> float:
    """Ms until a sweep has something to do: a node's heartbeat deadline or a range's loading
    deadline (0 when one passed; inf when none)."""
    bytes_per_block = {m.sha256: m.bytes_per_block for m in state.models}
    waits = [state.liveness.next_sweep_in_ms(now_ms)]
    for a, since in state.loading_since_ms.items():
        deadline = loading_deadline_ms(state.rules, a, bytes_per_block.get(a.model_sha256, 0))
        if deadline:
            waits.append(max(0, since + deadline - now_ms))
    return min(waits)


def ready_ranges(
    state: TrackerState, model_sha256: str, *, cleared: Callable[[RangeKey], bool], session_cap: int = 0
) -> list[ReadyRange]:
    """The ranges of ``model_sha256`` a route may go through: assigned to an alive node,
    reported READY with a recipe, not withdrawn, and ``cleared`` (the canary gate: checks off,
    or the range passed one since it became READY). ``session_cap``: sessions a range takes
    before routes go elsewhere (0: its worker's sequences)."""
    alive = state.liveness.alive
    live = live_sessions(state)
    ready = []
    for a, status in sorted(state.assignments.items()):
        key = (a.peer_id, a.model_sha256, a.begin, a.end)
        if (
            a.model_sha256 != model_sha256
            or a.peer_id not in alive
            or a.peer_id not in state.nodes
            or status.state != State.READY
            or not status.recipe_hash
            or (a.peer_id, a.model_sha256) in state.withdrawn
            or not cleared(key)
        ):
            continue
        in_use, total = live.get(key, (0, 0))
        tags = state.prefix_tags.get(a.peer_id, {}).get((a.model_sha256, a.begin, a.end), frozenset())
        ready.append(
            ReadyRange(
                peer_id=a.peer_id,
                addrs=seen_first(state.listen_addrs.get(a.peer_id, ()), state.seen_hosts.get(a.peer_id, "")),
                begin=a.begin,
                end=a.end,
                recipe_hash=status.recipe_hash,
                decode_s_per_block=state.nodes[a.peer_id].decode_s_per_block,
                sessions=in_use,
                capacity=min(total, session_cap) if session_cap else total,
                prefix_tags=tags,
            )
        )
    return ready


# --- transitions ------------------------------------------------------------------------------


def _with(mapping: Mapping[K, V], key: K, value: V) -> dict[K, V]:
    """A copy of ``mapping`` with ``key`` set (the state's mappings are never mutated)."""
    return {**mapping, key: value}


def _cleared_states(
    assignments: Mapping[Assignment, RangeStatus], peers: Iterable[str]
) -> dict[Assignment, RangeStatus]:
    """The assignment with every state of ``peers`` forgotten (what they had loaded is gone)."""
    gone = set(peers)
    return {a: RangeStatus() if a.peer_id in gone else status for a, status in assignments.items()}


def _registered(state: TrackerState, event: Registered, now_ms: int, effects: list[Effect]) -> TrackerState:
    facts, listen_addrs = event.facts, event.listen_addrs
    peer = facts.peer_id
    liveness, _heard = state.liveness.heard(peer, now_ms)
    effects += [ClearStatus(peer), ForgetChecks(peer), Log("info", f"admitted node {peer}")]
    state = dataclasses.replace(
        state,
        liveness=liveness,
        nodes=_with(state.nodes, peer, facts),
        listen_addrs=_with(state.listen_addrs, peer, listen_addrs),
        assignments=_cleared_states(state.assignments, [peer]),
        failed=frozenset(k for k in state.failed if k[0] != peer),
        withdrawn=frozenset(k for k in state.withdrawn if k[0] != peer),
        load_failures={p: f for p, f in state.load_failures.items() if p != peer},
        prefix_tags={p: t for p, t in state.prefix_tags.items() if p != peer},  # (a new start: caches empty)
        seen_hosts=_with(state.seen_hosts, peer, event.seen_host),
    )
    return _recompute(state, now_ms, effects)


def _heartbeat(state: TrackerState, beat: Heartbeat, now_ms: int, effects: list[Effect]) -> TrackerState:
    peer = beat.peer_id
    try:
        reading = read_report(peer, beat.serving, [m for p, m in state.failed if p == peer])
        check_listen_addrs(beat.listen_addrs or ())
        prefix_tags = read_prefixes(beat.prefixes)
    except WireError as err:
        effects.append(Refuse(err.code, err.message))
        return state
    liveness, heard = state.liveness.heard(peer, now_ms)
    effects.append(StoreHeartbeat(peer, beat.listen_addrs, reading.serving))
    assignments = dict(state.assignments)
    loading_since = dict(state.loading_since_ms)
    proven = state.proven
    for assigned, status in reading.reported.items():
        if assigned in assignments:  # a range not assigned to it is not recorded
            assignments[assigned] = RangeStatus(status.state, status.recipe_hash)
            effects.append(StoreStatus(assigned, status.state, status.recipe_hash, status.error))
            if status.state == State.READY:
                loading_since.pop(assigned, None)
                if not state.rules.proven_needs_check:
                    proven = proven | {peer}
            else:
                loading_since.setdefault(assigned, now_ms)
    load_failures = dict(state.load_failures)
    for assigned, status in sorted(reading.reported.items()):
        if status.state == State.FAILED and assigned.model_sha256 in reading.newly_failed:
            failure = swarm_pb2.AssignmentStatus()
            failure.CopyFrom(status)
            load_failures[peer] = (*load_failures.get(peer, ()), failure)
            effects.append(LoadFailed(peer, failure))
    state = dataclasses.replace(
        state,
        liveness=liveness,
        listen_addrs=state.listen_addrs
        if beat.listen_addrs is None
        else _with(state.listen_addrs, peer, beat.listen_addrs),
        assignments=assignments,
        loading_since_ms=loading_since,
        proven=proven,
        failed=state.failed | {(peer, m) for m in reading.newly_failed},
        load_failures=load_failures,
        heard_at_ms=_with(state.heard_at_ms, peer, now_ms),
        serving=_with(state.serving, peer, reading.serving),
        prefix_tags=_with(state.prefix_tags, peer, prefix_tags),
        peer_paths=_with(state.peer_paths, peer, beat.peer_paths[:MAX_PEER_PATHS]),
        seen_hosts=_with(state.seen_hosts, peer, beat.seen_host) if beat.seen_host else state.seen_hosts,
    )
    if heard.revived:
        effects.append(Log("info", f"node {peer} is back"))
    if heard.revived or reading.newly_failed:
        state = _recompute(state, now_ms, effects)
    mine = [(a, status.stored) for a, status in sorted(state.assignments.items()) if a.peer_id == peer]
    diff = diff_assignment(reading.reported, mine)
    if diff.unreported:  # assigned, not loaded (e.g. the node restarted): its stored state goes
        assignments = dict(state.assignments)
        loading_since = dict(state.loading_since_ms)
        for assigned in diff.unreported:
            assignments[assigned] = RangeStatus()
            loading_since.setdefault(assigned, now_ms)
            effects.append(StoreStatus(assigned, State.STATE_UNSPECIFIED, "", ""))
        state = dataclasses.replace(state, assignments=assignments, loading_since_ms=loading_since)
    effects += [SyncChecks(peer, diff.ready), Directives(peer, diff.load, diff.unload)]
    if heard.newly_confirmed or reading.reported:
        effects.append(Notify())
    return state


def loading_deadline_ms(rules: TrackerRules, assignment: Assignment, bytes_per_block: int) -> int:
    """How long ``assignment`` may take to become READY: the base plus its bytes at the slowest
    rate a node is allowed to fetch at (0: no deadline)."""
    if rules.loading_base_ms <= 0:
        return 0
    range_bytes = assignment.n_blocks * max(0, bytes_per_block)
    return rules.loading_base_ms + range_bytes * 1000 // max(1, rules.loading_min_bytes_per_s)


def _sweep(state: TrackerState, now_ms: int, effects: list[Effect]) -> TrackerState:
    liveness, dead = state.liveness.swept(now_ms)
    if dead:
        state = _mark_dead(
            dataclasses.replace(state, liveness=liveness), dead, "nodes missed heartbeats", now_ms, effects
        )
    state = _take_back_overdue(state, now_ms, effects)
    if now_ms - state.pruned_at_ms >= state.rules.registration_max_age_ms:
        effects.append(PruneNonces(now_ms - state.rules.nonce_retention_ms))
        state = dataclasses.replace(state, pruned_at_ms=now_ms)
    return state


def _reported(state: TrackerState, report: PeerReported, effects: list[Effect]) -> TrackerState:
    peer = report.peer_id
    if not peer:
        effects.append(Refuse(Code.INVALID_ARGUMENT, "ReportLostPeerRequest.peer_id is empty"))
    elif peer not in state.liveness:
        effects.append(ReportAnswered(peer, confirmed=peer in state.nodes, detail="not a live node"))
    elif peer not in state.suspects:  # else its probe is under way: the report shares its verdict
        state = dataclasses.replace(state, suspects=state.suspects | {peer})
        effects.append(ProbePeer(peer))
    return state


def _take_back_overdue(state: TrackerState, now_ms: int, effects: list[Effect]) -> TrackerState:
    """Ranges of live nodes not READY by their loading deadline are taken back: the model is
    not assigned to that node again until it registers anew (as a failed load)."""
    bytes_per_block = {m.sha256: m.bytes_per_block for m in state.models}
    live = state.liveness.live
    overdue = []
    for a, since in sorted(state.loading_since_ms.items()):
        deadline = loading_deadline_ms(state.rules, a, bytes_per_block.get(a.model_sha256, 0))
        if deadline and a.peer_id in live and a in state.assignments and now_ms - since >= deadline:
            overdue.append((a, deadline))
    if not overdue:
        return state
    load_failures = dict(state.load_failures)
    for a, deadline in overdue:
        failure = swarm_pb2.AssignmentStatus(
            assignment=swarm_pb2.Assignment(model_sha256=a.model_sha256, begin=a.begin, end=a.end),
            state=State.FAILED,
            error=f"not READY within {deadline / 1000:.0f} s of its assignment: taken back",
        )
        load_failures[a.peer_id] = (*load_failures.get(a.peer_id, ()), failure)
        effects.append(LoadFailed(a.peer_id, failure))
    state = dataclasses.replace(
        state,
        failed=state.failed | {(a.peer_id, a.model_sha256) for a, _ in overdue},
        load_failures=load_failures,
    )
    return _recompute(state, now_ms, effects)


def _mark_dead(
    state: TrackerState, dead: tuple[str, ...], why: str, now_ms: int, effects: list[Effect]
) -> TrackerState:
    effects.append(MarkDead(dead, why))
    gone = set(dead)
    former = {
        **state.former,
        **{a: now_ms for a, status in state.assignments.items() if a.peer_id in gone and status.state == State.READY},
    }
    state = dataclasses.replace(
        state,
        liveness=state.liveness.without(dead),
        assignments=_cleared_states(state.assignments, dead),
        former=former,
    )
    return _recompute(state, now_ms, effects)


def _given_back(state: TrackerState, now_ms: int) -> tuple[set[Assignment], dict[Assignment, int]]:
    """The current assignment with the ranges of nodes back from the dead given back to them
    where nodes that replaced them are still loading (not READY) the same blocks; and the
    former ranges still remembered (not given back, not expired)."""
    live = state.liveness.live
    current = set(state.assignments)
    remembered = {}
    for f, lost_at in sorted(state.former.items()):
        if now_ms - lost_at >= state.rules.former_memory_ms:
            continue
        if f.peer_id not in live:
            remembered[f] = lost_at
            continue
        usurpers = {
            a
            for a in current
            if a.model_sha256 == f.model_sha256
            and a.peer_id != f.peer_id
            and a.begin < f.end
            and f.begin < a.end
            and state.assignments[a].state != State.READY
        }
        current -= usurpers
        current.add(f)
    return current, remembered


def _recompute(state: TrackerState, now_ms: int, effects: list[Effect]) -> TrackerState:
    """The assignment recomputed from the models and the alive + pending nodes."""
    live = state.liveness.live
    nodes = [
        NodeCapacity(
            facts.peer_id,
            facts.usable_memory_bytes,
            facts.decode_s_per_block,
            frozenset(
                m
                for m in facts.model_sha256s | (state.fetchable if facts.fetches_models else frozenset())
                if (facts.peer_id, m) not in state.failed and (facts.peer_id, m) not in state.withdrawn
            ),
            proven=peer in state.proven,
        )
        for peer, facts in sorted(state.nodes.items())
        if peer in live
    ]
    current, former = _given_back(state, now_ms)
    new = assign(state.models, nodes, sorted(current))
    effects += [StoreAssignments(tuple(new)), Notify()]
    return dataclasses.replace(
        state,
        assignments={a: state.assignments.get(a, RangeStatus()) for a in new},
        loading_since_ms={
            a: state.loading_since_ms.get(a, now_ms)
            for a in new
            if state.assignments.get(a, RangeStatus()).state != State.READY
        },
        former=former,
        recomputes=state.recomputes + 1,
    )
