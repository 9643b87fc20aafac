"""Timestamps inside the swarm's hot path: a tracing tool for ``bench/compare.py`` and
``bench/batching.py``, and for anyone profiling the node path.

Owns: wrapping (at run time, without editing ``agent``) the calls one step goes through —
the node's step handler, the worker Forward (encode, call-thread hand-off, gRPC + compute,
decode), the push to the next hop and the message itself (the direct channel's request, frame
write and frame read; libp2p's when a message falls back to it) — so that each records a monotonic timestamp
(``time.perf_counter_ns``: CLOCK_MONOTONIC, one clock for every process on the machine);
switching recording on (SIGUSR1) and dumping it to ``$BATON_BENCH_TRACE_DIR/trace-<pid>.json``
(SIGUSR2); and ``step_breakdown``, which joins the client's and the nodes' events into
per-stage times of each decode step.

Node processes get the hooks through ``bench/tools/_trace/sitecustomize.py`` (on ``PYTHONPATH``
only for a profiled swarm), installed when ``agent.io.node.agent`` is first imported. A
method that is not there (renamed by a later change) is skipped and named in the dump, never
an error. While recording is off a hook costs one flag test; while on, two list appends.
"""

from __future__ import annotations

import bisect
import functools
import importlib.abc
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = [
    "ENV_DIR",
    "TraceFinder",
    "compute_times",
    "exchange_times",
    "forward_times",
    "install_client_hooks",
    "install_from_env",
    "install_worker_hooks",
    "load_dumps",
    "node_forwards",
    "round_breakdown",
    "span_stages",
    "step_breakdown",
]

ENV_DIR = "BATON_BENCH_TRACE_DIR"
STEP_PROTOCOL = "/baton/step/1.0.0"
RESULT_PROTOCOL = "/baton/result/1.0.0"

_events: list[tuple[int, str, object]] = []
_state = {"on": False}
_missing: list[str] = []


def _ev(name: str, extra: object = None) -> None:
    _events.append((time.perf_counter_ns(), name, extra))


def start() -> None:
    _events.clear()
    _state["on"] = True


def stop() -> list[tuple[int, str, object]]:
    _state["on"] = False
    return list(_events)


def _wrap(
    cls: type,
    name: str,
    tag: str,
    *,
    when: Callable[..., object] | None = None,
    static: bool = False,
    out: Callable[[object], object] | None = None,
) -> None:
    """Record ``<tag>_in`` / ``<tag>_out`` around ``cls.name`` (async or not) while on.

    ``when(*args)`` returns None to skip recording a call, else an extra value to record.
    ``out(self)``: the ``_out`` event's extra instead, read after a call that returned."""
    original = cls.__dict__.get(name)
    if original is None:
        _missing.append(f"{cls.__name__}.{name}")
        return
    fn = original.__func__ if isinstance(original, staticmethod) else original
    if getattr(fn, "__hop_trace__", False):
        return  # hooked already
    is_async = getattr(fn, "__code__", None) is not None and fn.__code__.co_flags & 0x80  # CO_COROUTINE

    if is_async:

        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            extra = when(*args, **kwargs) if (_state["on"] and when is not None) else 0
            if not _state["on"] or extra is None:
                return await fn(*args, **kwargs)
            _ev(tag + "_in", extra)
            try:
                result = await fn(*args, **kwargs)
            except BaseException:
                _ev(tag + "_out", extra)
                raise
            _ev(tag + "_out", extra if out is None else out(args[0]))
            return result

    else:

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            extra = when(*args, **kwargs) if (_state["on"] and when is not None) else 0
            if not _state["on"] or extra is None:
                return fn(*args, **kwargs)
            _ev(tag + "_in", extra)
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                _ev(tag + "_out", extra)
                raise
            _ev(tag + "_out", extra if out is None else out(args[0]))
            return result

    wrapper.__hop_trace__ = True
    setattr(cls, name, staticmethod(wrapper) if static or isinstance(original, staticmethod) else wrapper)


def _is_step_or_result(_self, _peer_id, _addrs, protocol_id, payload, *a, **k):
    return len(payload) if protocol_id in (STEP_PROTOCOL, RESULT_PROTOCOL) else None


def _is_step_or_result_soon(_self, _peer_id, protocol_id, payload, *a, **k):
    return len(payload) if protocol_id in (STEP_PROTOCOL, RESULT_PROTOCOL) else None


def _install_transport_hooks() -> None:
    """The step and result messages on both paths: the direct channel (its ``request``, the
    frame write, and the frame reader taking in what TLS decrypted) and libp2p (the fallback)."""
    from agent.core.net import frames
    from agent.io.net import channel, channel_connection, p2p_streams, p2p_transport

    _wrap(channel.ChannelTransport, "request", "req", when=_is_step_or_result)
    # a push sent from the serving task (request_soon): the request and its frame write in one call
    _wrap(channel.ChannelTransport, "request_soon", "req", when=_is_step_or_result_soon)
    _wrap(channel_connection._Connection, "send_frame", "wr", when=lambda _self, _header, payload: len(payload))
    _wrap(
        channel_connection._Connection,
        "request_soon",
        "wr",
        when=lambda _self, _protocol_id, payload, **_k: len(payload),
    )
    # the channel decrypts straight into the reader's buffer, then commits what came
    _wrap(frames.FrameReader, "commit", "rd")
    _wrap(p2p_transport.P2PTransport, "request", "req", when=_is_step_or_result)
    framed = getattr(p2p_streams, "_FramedStream", None)
    if framed is None:
        _missing.append("p2p_streams._FramedStream")
    else:
        _wrap(framed, "write_frame", "wr", when=lambda _self, payload: len(payload))
        _wrap(framed, "read_frame", "rd")


def install_worker_hooks() -> None:
    """The worker Forward: the async call (encode, the exchange, decode), the exchange itself
    (the Forward stream's, or the gRPC call's), and with gRPC the blocking call on the client's
    call thread (``WorkerClient.blocking_call``: gRPC + the worker's compute)."""
    from agent.io.worker import client as worker_client
    from agent.io.worker import stream as worker_stream

    # extra: the Forward's entries (sequences), which tells a lock-step round's Forwards apart;
    # at fwd_out, the worker's own time in it (µs, ForwardReply.compute_us)
    _wrap(
        worker_client.AsyncWorkerClient, "forward", "fwd",
        when=lambda _s, entries, *a, **k: len(entries), out=_forward_compute_us,
    )  # fmt: skip
    _wrap(
        worker_client.AsyncWorkerClient,
        "call",
        "call",
        when=lambda _s, method, *a, **k: 1 if method == "Forward" else None,
    )
    _wrap(worker_stream._ForwardStream, "exchange", "call")
    _wrap(
        worker_client.WorkerClient,
        "blocking_call",
        "thr",
        when=lambda _s, method, *a, **k: 1 if method == "Forward" else None,
    )


def _forward_compute_us(client) -> int:
    timing = getattr(client, "last_forward", None)
    return 0 if timing is None else int(timing.compute_us)


def _defining_class(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO that defines ``name`` (``Node`` is made of one mixin per job,
    ``agent.io.node.agent``); ``cls`` when none does (``_wrap`` then names it missing)."""
    return next((c for c in cls.__mro__ if name in c.__dict__), cls)


def install_node_hooks(agent_module) -> None:
    node = agent_module.Node
    _wrap(_defining_class(node, "answer_step"), "answer_step", "step", when=lambda _self, _remote, data: len(data))
    _wrap(_defining_class(node, "_accept_step"), "_accept_step", "accept")
    _wrap(_defining_class(node, "_push"), "_push", "push")
    _wrap(_defining_class(node, "_push_now"), "_push_now", "push")
    install_worker_hooks()
    _install_transport_hooks()


def install_client_hooks() -> None:
    """Hooks in this process (the client): sending a step, a result arriving."""
    from agent.io.client import steps

    _wrap(steps.StepClient, "_send_step", "send", when=lambda _self, _first, request, **_kwargs: int(request.step))
    _wrap(steps.StepClient, "_send_step_soon", "send", when=lambda _self, _live, _first, request: int(request.step))
    _wrap(steps.StepClient, "_on_result", "result")
    _install_transport_hooks()


def _dump(path: Path) -> None:
    events = stop()
    path.write_text(json.dumps({"pid": os.getpid(), "missing_hooks": _missing, "events": events}))


class TraceFinder(importlib.abc.MetaPathFinder):
    """Installs the node hooks right after ``agent.io.node.agent`` is executed."""

    target = "agent.io.node.agent"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader

                def exec_and_hook(module, exec_module=loader.exec_module):
                    exec_module(module)
                    install_node_hooks(module)

                loader.exec_module = exec_and_hook
                return spec
        return None


def install_from_env() -> None:
    """Called by ``bench/tools/_trace/sitecustomize.py``: with ``$BATON_BENCH_TRACE_DIR`` set,
    hook the node module when it is imported; SIGUSR1 starts recording, SIGUSR2 dumps."""
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return
    sys.meta_path.insert(0, TraceFinder())
    dump_path = Path(directory) / f"trace-{os.getpid()}.json"
    signal.signal(signal.SIGUSR1, lambda *_: start())
    signal.signal(signal.SIGUSR2, lambda *_: _dump(dump_path))


def load_dumps(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("trace-*.json"))]


# --- analysis (pure) ------------------------------------------------------------------------

#: (stage, from event, to event) within one node's step, in order. The worker computes from
#: the moment the gRPC call is started, so compute overlaps the stages from "start the call"
#: to "wait for the reply"; "Forward call, all of it" is their sum.
NODE_STAGES = (
    ("step handler: parse, admission check, validate, queue", "accept_in", "accept_out"),
    ("wake the serving task", "accept_out", "fwd_in"),
    ("encode the Forward request", "fwd_in", "call_in"),
    ("the worker exchange: send, worker compute, reply (Forward stream or gRPC)", "call_in", "call_out"),
    ("hand-off to a call thread", "call_in", "thr_in"),
    ("blocking gRPC call on that thread (worker compute + gRPC)", "thr_in", "thr_out"),
    ("hand-back to the trio task", "thr_out", "call_out"),
    ("decode the Forward reply", "call_out", "fwd_out"),
    ("Forward call, all of it (encode to decode)", "fwd_in", "fwd_out"),
    ("start the push (from the serving task, or a task)", "fwd_out", "push_in"),
    ("build + serialize the next message", "push_in", "req_in"),
    ("in the node, all of it (step handler to the next request)", "step_in", "req_in"),
)

#: (stage, from event, to event) of one message (channel or libp2p): sender's events, then
#: the receiver's
LINK_STAGES = (
    ("sender: request() until the frame write", "req_in", "wr_in"),
    ("sender: write the frame (encrypt, socket)", "wr_in", "wr_out"),
    ("kernel, wake-up and decrypt until the frame reader has it", "wr_out", "rd_in"),
    ("receiver: take the frame in", "rd_in", "rd_out"),
    ("receiver: hand it to the handler", "rd_out", "handler_in"),
    ("one way, all of it", "req_in", "handler_in"),
)


def _first_times(events: Sequence[Sequence]) -> dict[str, int]:
    """First time of each event name, and the write of the request (the ``wr_in``/``wr_out``
    of the same size as the first ``req_in``: a node also writes acks meanwhile)."""
    first: dict[str, int] = {}
    for t, name, _extra in events:
        first.setdefault(name, t)
    req = next(((t, extra) for t, name, extra in events if name == "req_in"), None)
    first.pop("wr_in", None)
    first.pop("wr_out", None)
    if req is not None:
        for t, name, extra in events:
            if t >= req[0] and name in ("wr_in", "wr_out") and extra == req[1] and name not in first:
                first[name] = t
    return first


def _node_steps(events: Sequence[Sequence]) -> list[dict[str, int]]:
    """A node's events cut into steps: each ``step_in`` opens one; ``rd_in``/``rd_out`` are
    the last frame read before it (the incoming request)."""
    steps: list[dict] = []
    chunks: list[list] = []
    last_rd: dict[str, int] = {}
    for t, name, extra in events:
        if name in ("rd_in", "rd_out"):
            last_rd[name] = t
        if name == "step_in":
            steps.append({"step_in": t, "handler_in": t, "bytes_in": extra, **last_rd})
            chunks.append([])
        elif chunks:
            chunks[-1].append((t, name, extra))
    for step, chunk in zip(steps, chunks, strict=True):
        for name, t in _first_times(chunk).items():
            step.setdefault(name, t)
    return steps


def _client_steps(events: Sequence[Sequence]) -> list[dict]:
    """The client's steps: ``send_in`` (extra: step number) to ``result_in``."""
    steps: list[dict] = []
    chunk: list = []
    last_rd: dict[str, int] = {}
    for t, name, extra in events:
        if name in ("rd_in", "rd_out"):
            last_rd[name] = t
        if name == "send_in":
            chunk = [(t, name, extra)]
        elif name == "result_in" and chunk:
            first = _first_times(chunk)
            steps.append(
                {
                    "step": chunk[0][2],
                    "send_in": chunk[0][0],
                    "result_in": t,
                    **first,
                    "rd_in_result": last_rd.get("rd_in"),
                    "rd_out_result": last_rd.get("rd_out"),
                }
            )
            chunk = []
        elif chunk:
            chunk.append((t, name, extra))
    return steps


_SENDER_EVENTS = ("req_in", "wr_in", "wr_out")


def _stages(sender: Mapping[str, int], receiver: Mapping[str, int | None]) -> dict[str, float]:
    """``LINK_STAGES`` of one message from ``sender``'s events to ``receiver``'s."""
    out = {}
    for stage, a, b in LINK_STAGES:
        ta = (sender if a in _SENDER_EVENTS else receiver).get(a)
        tb = (sender if b in _SENDER_EVENTS else receiver).get(b)
        if ta is not None and tb is not None:
            out[stage] = (tb - ta) / 1e6
    return out


def _median_dicts(rows: Sequence[Mapping[str, float]], order: Sequence[str]) -> dict[str, float]:
    return {k: statistics.median([r[k] for r in rows if k in r]) for k in order if any(k in r for r in rows)}


def step_breakdown(client_events: Sequence[Sequence], node_dumps: Sequence[Mapping]) -> dict:
    """Per-stage medians (ms) over the decode steps (step > 0) of the client's generations.

    Returns ``{"steps", "hops": [{node stage: ms}], "links": [{link stage: ms}], "total_ms",
    "sum_of_stages_ms", "missing_hooks"}``: ``links[0]`` is client -> hop 1, ``links[i]`` hop
    i -> hop i+1, ``links[-1]`` last hop -> client (the logits row). The links' and the
    nodes' "all of it" rows add up to the step the client sees, less the client's own time
    before its request (``sum_of_stages_ms``)."""
    nodes = [_node_steps(d["events"]) for d in node_dumps]
    missing = sorted({m for d in node_dumps for m in d.get("missing_hooks", [])})
    hop_rows: dict[int, list[dict[str, float]]] = {}
    link_rows: dict[int, list[dict[str, float]]] = {}
    totals: list[float] = []
    n_hops = 0
    for c in _client_steps(client_events):
        if c["step"] == 0:
            continue  # prefill
        t0, t1 = c["send_in"], c["result_in"]
        hits = []
        for steps in nodes:
            inside = [s for s in steps if t0 <= s["step_in"] <= t1]
            if inside:
                hits.append(inside[0])
        hits.sort(key=lambda s: s["step_in"])
        if not hits or not all("req_in" in s for s in hits):
            continue
        n_hops = len(hits)
        totals.append((t1 - t0) / 1e6)
        sender: Mapping[str, int] = c
        for i, s in enumerate(hits):
            link_rows.setdefault(i, []).append(_stages(sender, s))
            hop_rows.setdefault(i, []).append(
                {stage: (s[b] - s[a]) / 1e6 for stage, a, b in NODE_STAGES if a in s and b in s}
            )
            sender = s
        back = {"rd_in": c["rd_in_result"], "rd_out": c["rd_out_result"], "handler_in": t1}
        link_rows.setdefault(len(hits), []).append(_stages(sender, back))
    node_order = [stage for stage, _a, _b in NODE_STAGES]
    link_order = [stage for stage, _a, _b in LINK_STAGES]
    hops = [_median_dicts(hop_rows[i], node_order) for i in range(n_hops)]
    links = [_median_dicts(link_rows[i], link_order) for i in sorted(link_rows)]
    sum_ms = sum(h.get(NODE_STAGES[-1][0], 0.0) for h in hops) + sum(
        link.get(LINK_STAGES[-1][0], 0.0) for link in links
    )
    return {
        "steps": len(totals),
        "hops": hops,
        "links": links,
        "total_ms": statistics.median(totals) if totals else 0.0,
        "sum_of_stages_ms": sum_ms,
        "missing_hooks": missing,
    }


def forward_times(events: Sequence[Sequence], n_ranges: int) -> list[float]:
    """Median ms of each range's Forward call (``fwd_in`` to ``fwd_out``) in a chain driven
    from one process, decode steps only (the first ``n_ranges`` calls of a generation are
    its prefill; one generation per trace)."""
    decode = _durations_ms(events, "fwd_in", "fwd_out")[n_ranges:]
    return _per_range_medians(decode, n_ranges)


def node_forwards(events: Sequence[Sequence]) -> list[dict[str, int]]:
    """A node's worker Forwards, in order: ``fwd_in`` (with ``entries``, the sequences in it),
    ``call_in``/``call_out`` (the exchange with the worker: its compute) and ``fwd_out`` (with
    ``compute_us``, the worker's own time in it: 0 when it did not say)."""
    forwards: list[dict[str, int]] = []
    for t, name, extra in events:
        if name == "fwd_in":
            forwards.append({"fwd_in": t, "entries": int(extra)})
        elif forwards and name in ("call_in", "call_out", "fwd_out") and name not in forwards[-1]:
            forwards[-1][name] = t
            if name == "fwd_out":
                forwards[-1]["compute_us"] = int(extra or 0)
    return [f for f in forwards if {"call_in", "call_out", "fwd_out"} <= f.keys()]


def _next_after(forwards: list[dict[str, int]], t: int) -> dict[str, int] | None:
    return next((f for f in forwards if f["call_in"] > t), None)


def round_breakdown(hops: Sequence[Sequence[Sequence]], entries: int) -> dict:
    """Where a lock-step round goes: ``hops`` are the nodes' events in route order; a round is
    a first-hop Forward of ``entries`` sequences (every session's decode step), followed by the
    next such Forward at each later hop. Medians over rounds, ms:

    - ``exchange_ms``: per hop, the exchange with its worker (send, compute, reply);
    - ``compute_ms``: per hop, the worker's own time in that Forward (``ForwardReply.compute_us``);
    - ``handoff_ms``: hop k's reply to hop k+1's exchange (decode the reply, push, the message,
      the step handlers, the next Forward's start);
    - ``loop_ms``: the last hop's reply to the first hop's next round (the results to every
      owner, their next steps, the first hop's wait for all of them);
    - ``round_ms``: one first-hop exchange to the next round's;
    - ``handoff_stages_ms`` (per hand-off) and ``loop_stages_ms``: the same spans cut at the
      events in between (``HANDOFF_STAGES``, ``LOOP_STAGES``, ``span_stages``), each stage's
      ``[what, median ms, rounds it was found in]``; medians, so they need not add up to the
      span's.

    Rounds whose next round is not in the trace (the last) count in all but ``round_ms`` and
    ``loop_ms``."""
    per_hop = [[f for f in node_forwards(events) if f["entries"] == entries] for events in hops]
    rounds = []
    for first in per_hop[0]:
        chain = [first]
        for later in per_hop[1:]:
            following = _next_after(later, chain[-1]["call_out"])
            if following is None:
                break
            chain.append(following)
        if len(chain) == len(per_hop):
            rounds.append(chain)
    if not rounds:
        return {"rounds": 0}
    closed = [(chain, _next_after(per_hop[0], chain[-1]["call_out"])) for chain in rounds]
    closed = [(chain, after) for chain, after in closed if after is not None]
    ms = 1e-6

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    handoff_stages = [
        _median_stages(
            [span_stages(hops[k], hops[k + 1], c[k]["call_out"], c[k + 1]["call_in"], HANDOFF_STAGES) for c in rounds],
            HANDOFF_STAGES,
        )
        for k in range(len(hops) - 1)
    ]  # fmt: skip
    loop_stages = _median_stages(
        [span_stages(hops[-1], hops[0], c[-1]["call_out"], after["call_in"], LOOP_STAGES) for c, after in closed],
        LOOP_STAGES,
    )  # fmt: skip
    return {
        "rounds": len(rounds),
        "entries": entries,
        "exchange_ms": [median([(c[k]["call_out"] - c[k]["call_in"]) * ms for c in rounds]) for k in range(len(hops))],
        "compute_ms": [median([c[k]["compute_us"] / 1000 for c in rounds]) for k in range(len(hops))],
        "handoff_ms": [
            median([(c[k + 1]["call_in"] - c[k]["call_out"]) * ms for c in rounds]) for k in range(len(hops) - 1)
        ],
        "loop_ms": median([(after["call_in"] - chain[-1]["call_out"]) * ms for chain, after in closed]),
        "round_ms": median([(after["call_in"] - chain[0]["call_in"]) * ms for chain, after in closed]),
        "handoff_stages_ms": handoff_stages,
        "loop_stages_ms": loop_stages,
    }


#: A stage of a span between two processes: (what it is, whose events end it: "from" or "to",
#: the event that ends it, "first" such event after the stage before ends, or the "last" one
#: before the span ends).
Stage = tuple[str, str, str, str]

#: hop k's worker reply to hop k+1's next exchange, stage by stage
HANDOFF_STAGES: tuple[Stage, ...] = (
    ("sender: the worker's reply decoded", "from", "fwd_out", "first"),
    ("sender: outputs taken (rows kept, push groups)", "from", "push_in", "first"),
    ("sender: the next hop's steps built and serialized", "from", "wr_in", "first"),
    ("sender: the frame written (TLS, socket)", "from", "wr_out", "first"),
    ("kernel, wake-up, decrypt until the receiver's frame reader has it", "to", "rd_in", "first"),
    ("receiver: the step handlers, every step of the batch", "to", "accept_out", "last"),
    ("receiver: the serving task wakes and takes the batch", "to", "fwd_in", "first"),
    ("receiver: the Forward request encoded and sent", "to", "call_in", "first"),
)

#: the last hop's worker reply to the first hop's next round, stage by stage
LOOP_STAGES: tuple[Stage, ...] = (
    ("last hop: the worker's reply decoded", "from", "fwd_out", "first"),
    ("last hop: every owner's result built and written", "from", "wr_out", "last"),
    ("owners: results taken, tokens chosen, until the first next step is accepted", "to", "accept_in", "first"),
    ("first hop: the other owners' steps, until the last is accepted", "to", "accept_out", "last"),
    ("first hop: the gather ends, the serving task takes the batch", "to", "fwd_in", "first"),
    ("first hop: the Forward request encoded and sent", "to", "call_in", "first"),
)


def span_stages(
    from_events: Sequence[Sequence], to_events: Sequence[Sequence], start: int, end: int, stages: Sequence[Stage]
) -> list[float | None]:
    """ms of each of ``stages`` in the span ``[start, end]`` (ns) from one process
    (``from_events``) to another (``to_events``): each stage runs from where the one before
    ended to its event. A stage whose event is not in the span is None, and the next stage
    counts from where the last one found ended (so the found stages always add up to the span)."""
    events = {"from": _window(from_events, start, end), "to": _window(to_events, start, end)}
    out: list[float | None] = []
    at = start
    for _what, whose, name, which in stages:
        times = [t for t, n, _x in events[whose] if n == name and t >= at]
        if not times:
            out.append(None)
            continue
        t = times[0] if which == "first" else times[-1]
        out.append((t - at) / 1e6)
        at = t
    return out


def _window(events: Sequence[Sequence], start: int, end: int) -> Sequence[Sequence]:
    """The events of one process (in time order) from ``start`` to ``end``, both included."""
    first = bisect.bisect_left(events, start, key=lambda e: e[0])
    return events[first : bisect.bisect_right(events, end, lo=first, key=lambda e: e[0])]


def _median_stages(per_span: Sequence[Sequence[float | None]], stages: Sequence[Stage]) -> list[list]:
    """``[what, median ms or None, spans it was found in]`` of each stage."""
    rows = []
    for i, (what, *_rest) in enumerate(stages):
        found = [span[i] for span in per_span if span[i] is not None]
        rows.append([what, statistics.median(found) if found else None, len(found)])
    return rows


def compute_times(events: Sequence[Sequence], n_ranges: int) -> list[float]:
    """Median ms of each range's own time in its Forwards (the worker's ``compute_us``, at
    ``fwd_out``) in a chain driven from one process, every call in the trace."""
    computed = [int(extra or 0) / 1000 for _t, name, extra in events if name == "fwd_out"]
    return _per_range_medians(computed, n_ranges)


def exchange_times(events: Sequence[Sequence], n_ranges: int) -> list[float]:
    """Median ms of each range's worker exchange (``call_in`` to ``call_out``) in a chain
    driven from one process, every call in the trace (start it after the prefill)."""
    calls = _durations_ms(events, "call_in", "call_out")
    return _per_range_medians(calls, n_ranges)


def _per_range_medians(values: Sequence[float], n_ranges: int) -> list[float]:
    """Each range's median of ``values``, taken from a chain's calls in turn (range 0, 1, ...,
    0, 1, ...); [] when there are none."""
    return [statistics.median(values[i::n_ranges]) for i in range(n_ranges)] if values else []


def _durations_ms(events: Sequence[Sequence], opening: str, closing: str) -> list[float]:
    """Each ``opening`` event to the ``closing`` one after it, ms, in order (one process's
    calls, one at a time)."""
    durations, start = [], None
    for t, name, _extra in events:
        if name == opening:
            start = t
        elif name == closing and start is not None:
            durations.append((t - start) / 1e6)
            start = None
    return durations
