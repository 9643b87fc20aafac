"""A soak across the lab: a relay serving many clients while machines die and links drop.

Owns one benchmark: six emulated machines (tracker, relay, n1..n4), every pair 10-50 ms apart
(each pair its own delay) with 1 % loss; four nodes each holding half of SmolLM2 (two copies
of every range), 8 sequences a worker; the relay; ``--clients`` concurrent users on the
tracker's machine, each asking the relay for one streamed greedy completion after another (the
official ``openai`` client, a prompt from a fixed set, ``--max-tokens`` tokens) for
``--duration-s``. Meanwhile a chaos timeline: every ``--kill-every-s`` a node machine (n1 and
n2 in turn) is switched off (cut from the network, its processes killed) and brought back
``--down-s`` later (same key); every ``--cut-every-s`` one link between two node machines is
cut for ``--cut-s``.

Reported: requests served and failed (by reason: a 429 or 503 answer is the relay's documented
refusal, anything else a failure), whether each completion equals its prompt's undisturbed
reference (one unsplit worker's greedy text), p50/p99 time to first token and gap between
streamed tokens, and the RSS of every process at the end of warm-up and at the end (those that
lived through the run are held to within 15 %).

Writes ``soak.json`` and ``soak.md`` under ``--out``. Needs root (the lab). Run it alone.
``tests/test_soak.py`` runs a 100-second version in the default suite.

Usage: ``sudo .venv/bin/python bench/soak.py [--duration-s 600] [--clients 16] [--out bench/results]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import itertools
import tempfile
import threading
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (first: it makes the project importable)
import openai
import psutil
import trio
from common import log, machine_info, publish

from agent.core.lab.topology import LinkSpec, MachineSpec, Topology
from agent.demo.local_demo import generate_through
from agent.demo.swarm_demo import node_memory_bytes, wait_for_copies
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig, Placement
from agent.io.client import open_swarm_client
from agent.io.lab.harness import Lab, running_lab
from agent.io.worker.process import open_worker
from agent.models import model_path, sha256_file

ALIAS = "smollm2"
NODES = ("n1", "n2", "n3", "n4")
FLAKY = ("n1", "n2")  # switched off in turn; n3 and n4 live through the run (their RSS is held)
MACHINES = ("tracker", "relay", *NODES)
CLIENTS_ON = "tracker"
LOSS_PCT = 1.0
PROMPTS = (
    "The three primary colors are",
    "A good way to learn a new language is",
    "Volunteer computing works because",
    "The capital of France is Paris, and the capital of Italy is",
)
DOCUMENTED_REFUSALS = (429, 503)
SETUP_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 180.0
RSS_TOLERANCE = 0.15


def pair_delay_ms(i: int, j: int) -> float:
    """One way, 5-25 ms (a round trip of 10-50 ms), fixed per pair and spread over the range."""
    return 5.0 + ((i * 7 + j * 13) % 21)


def topology() -> Topology:
    machines = tuple(MachineSpec(m) for m in MACHINES)
    links = []
    for (i, a), (j, b) in itertools.combinations(enumerate(MACHINES), 2):
        spec = LinkSpec(delay_ms=pair_delay_ms(i, j), loss_pct=LOSS_PCT)
        links += [(a, b, spec), (b, a, spec)]
    return Topology(machines, LinkSpec(loss_pct=LOSS_PCT), tuple(links))


async def _references(path: Path, max_tokens: int) -> dict[str, str]:
    """Each prompt's greedy text from one unsplit worker, tokenized as the relay does."""
    sha256 = sha256_file(path)
    texts = {}
    async with open_worker(path, 0, None, threads=1, max_sequences=1, model_sha256=sha256) as single:
        async with open_worker(path, 0, None, vocab_only=True, model_sha256=sha256) as vocab_worker:
            vocab = await vocab_worker.client.vocabulary()
        eog = set(single.info.eog_token_ids)
        for prompt in PROMPTS:
            tokens = await single.client.tokenize(prompt, add_special=True, parse_special=True)
            out = await generate_through([single.client], tokens, max_tokens, stop_tokens=list(eog))
            pieces = [vocab.pieces[t] for t in out.tokens if t not in eog]
            texts[prompt] = b"".join(pieces).decode("utf-8", "replace")
    return texts


@dataclasses.dataclass
class Outcome:
    prompt: str
    started_s: float
    status: str  # "ok", "refused 429/503", or a failure's reason
    text: str = ""
    first_token_s: float | None = None
    gaps_s: list[float] = dataclasses.field(default_factory=list)


def one_request(client: openai.OpenAI, prompt: str, max_tokens: int, t0: float) -> Outcome:
    started = time.perf_counter()
    outcome = Outcome(prompt, started - t0, "ok")
    last = None
    try:
        stream = client.completions.create(
            model=ALIAS, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        with stream:
            for chunk in stream:
                piece = chunk.choices[0].text if chunk.choices else ""
                if not piece:
                    continue
                now = time.perf_counter()
                if last is None:
                    outcome.first_token_s = now - started
                else:
                    outcome.gaps_s.append(now - last)
                last = now
                outcome.text += piece
    except openai.APIStatusError as err:
        outcome.status = (
            f"refused {err.status_code}"
            if err.status_code in DOCUMENTED_REFUSALS
            else f"HTTP {err.status_code}: {err.message[:200]}"
        )
    except (openai.APIError, OSError) as err:
        outcome.status = f"{type(err).__name__}: {str(err)[:200]}"
    return outcome


def run_clients(
    base_url: str, key: str, clients: int, duration_s: float, max_tokens: int, stop: threading.Event
) -> list[Outcome]:
    """``clients`` users asking one completion after another until ``duration_s`` (call inside
    the clients' machine: their threads and sockets stay there)."""
    t0 = time.perf_counter()
    deadline = t0 + duration_s
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def user(index: int) -> None:
        with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=REQUEST_TIMEOUT_S) as client:
            for n in itertools.count():
                if time.perf_counter() >= deadline or stop.is_set():
                    return
                outcome = one_request(client, PROMPTS[(index + n) % len(PROMPTS)], max_tokens, t0)
                with lock:
                    outcomes.append(outcome)

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(user, range(clients)))
    return outcomes


def rss_mb(swarm: LocalSwarm) -> dict[str, float]:
    """Every swarm process and its children (workers): RSS in MB, by name."""
    out = {}
    procs = {"tracker": swarm.tracker, "relay": swarm.relay, **swarm.nodes}
    for name, proc in procs.items():
        if proc is None or not proc.alive:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(proc.process.pid)
            out[f"{name} (pid {root.pid})"] = root.memory_info().rss / 2**20
            for child in root.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    out[f"{name} {child.name()} (pid {child.pid})"] = child.memory_info().rss / 2**20
    return out


def chaos(
    lab: Lab, swarm: LocalSwarm, memory: int, args: argparse.Namespace, stop: threading.Event, events: list[dict]
) -> None:
    """The timeline: machines switched off and back, links cut and healed, until ``stop``."""
    t0 = time.monotonic()
    pending: list[tuple[float, str, str]] = []
    kills = itertools.cycle(FLAKY)
    cuts = itertools.cycle([("n1", "n3"), ("n2", "n4"), ("n3", "n4"), ("n1", "n2")])
    next_kill = args.kill_every_s
    next_cut = args.cut_every_s
    while not stop.is_set():
        now = time.monotonic() - t0
        for when, what, name in sorted(pending):
            if when <= now:
                pending.remove((when, what, name))
                if what == "up":
                    lab.isolate(name, up=True)
                    swarm.start_node(name, memory, ["--max-sequences", str(args.sequences)])
                else:
                    a, b = name.split("-")
                    lab.heal(a, b)
                events.append({"t_s": now, "event": what, "target": name})
                log(f"  {now:5.0f} s: {what} {name}")
        if now >= next_kill:
            name = next(kills)
            lab.isolate(name)
            swarm.kill_node_nowait(name)
            pending.append((now + args.down_s, "up", name))
            events.append({"t_s": now, "event": "machine off", "target": name})
            log(f"  {now:5.0f} s: machine {name} off")
            next_kill += args.kill_every_s
        if now >= next_cut:
            a, b = next(cuts)
            lab.cut(a, b)
            pending.append((now + args.cut_s, "heal", f"{a}-{b}"))
            events.append({"t_s": now, "event": "link cut", "target": f"{a}-{b}"})
            log(f"  {now:5.0f} s: link {a}-{b} cut")
            next_cut += args.cut_every_s
        stop.wait(0.1)  # the timeline's tick (pacing, not synchronisation)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(outcomes: list[Outcome], references: dict[str, str], rss_start: dict, rss_end: dict) -> dict:
    served = [o for o in outcomes if o.status == "ok"]
    refused = [o for o in outcomes if o.status.startswith("refused")]
    failed = [o for o in outcomes if o.status != "ok" and not o.status.startswith("refused")]
    wrong = [o for o in served if o.text != references[o.prompt]]
    reasons: dict[str, int] = {}
    for o in failed + refused:
        reasons[o.status] = reasons.get(o.status, 0) + 1
    ttft = [o.first_token_s for o in served if o.first_token_s is not None]
    gaps = [g for o in served for g in o.gaps_s]
    held = {}
    for name, start in rss_start.items():
        if name in rss_end:
            held[name] = {"start_mb": start, "end_mb": rss_end[name], "ratio": rss_end[name] / start,
                          "within": abs(rss_end[name] / start - 1) <= RSS_TOLERANCE}  # fmt: skip
    return {
        "requests": len(outcomes),
        "served": len(served),
        "refused": len(refused),
        "failed": len(failed),
        "reasons": reasons,
        "served_equal_to_reference": len(served) - len(wrong),
        "served_different": [{"prompt": o.prompt, "text": o.text, "expected": references[o.prompt]} for o in wrong[:5]],
        "first_token_s": {
            "p50": _percentile(ttft, 0.5),
            "p99": _percentile(ttft, 0.99),
            "max": max(ttft, default=None),
        },
        "token_gap_s": {"p50": _percentile(gaps, 0.5), "p99": _percentile(gaps, 0.99), "max": max(gaps, default=None)},
        "rss": held,
        "rss_all_within": all(h["within"] for h in held.values()),
        # a node given another range starts a new worker: those are reported, not held
        "rss_replaced": sorted(set(rss_start) - set(rss_end)),
        "rss_new": sorted(set(rss_end) - set(rss_start)),
    }


def run_soak(args: argparse.Namespace, workdir: Path) -> dict:
    """The whole soak; returns the report (without the machine)."""
    path = model_path(ALIAS)
    references = trio.run(_references, path, args.max_tokens)
    with running_lab(topology(), args.lab_name) as lab:
        placement = Placement(lab, {m: m for m in MACHINES})
        swarm = LocalSwarm(LocalSwarmConfig(model_path=path, model_alias=ALIAS, placement=placement), workdir)
        try:

            async def start() -> int:
                await swarm.start_tracker()
                async with open_swarm_client(swarm.tracker_addr, listen_addrs=lab.listen_addrs(CLIENTS_ON)) as c:
                    (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
                    memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, 2)  # two copies in four nodes
                    for name in NODES:
                        swarm.start_node(name, memory, ["--max-sequences", str(args.sequences)])
                    await wait_for_copies(c, swarm, 2, timeout_s=SETUP_TIMEOUT_S)
                await swarm.start_relay()
                return memory

            memory = lab.trio_run_in(CLIENTS_ON, start)
            key = swarm.add_relay_key("soak")
            base_url = f"{swarm.relay_url}/v1"
            log(f"warm-up: {args.warmup_s:g} s of {args.clients} clients, no chaos")
            warm = lab.run_in(
                CLIENTS_ON,
                lambda: run_clients(base_url, key, args.clients, args.warmup_s, args.max_tokens, threading.Event()),
            )
            rss_start = rss_mb(swarm)
            log(f"soak: {args.duration_s:g} s ({len(warm)} warm-up requests)")
            stop = threading.Event()
            events: list[dict] = []
            chaos_thread = threading.Thread(target=chaos, args=(lab, swarm, memory, args, stop, events), daemon=True)
            chaos_thread.start()
            try:
                outcomes = lab.run_in(
                    CLIENTS_ON,
                    lambda: run_clients(
                        base_url, key, args.clients, args.duration_s, args.max_tokens, threading.Event()
                    ),
                )
            finally:
                stop.set()
                chaos_thread.join()
            rss_end = rss_mb(swarm)
            forwarder = lab.stats()
        finally:
            swarm.close_nowait()
    report = summarize(outcomes, references, rss_start, rss_end)
    report.update(
        duration_s=args.duration_s, clients=args.clients, max_tokens=args.max_tokens, warmup_requests=len(warm),
        events=events, lost_packets=sum(r["drop_loss"] for r in forwarder["links"]),
        cut_packets=sum(r["drop_down"] for r in forwarder["links"]),
    )  # fmt: skip
    return report


def markdown(report: dict) -> str:
    ft, gap = report["first_token_s"], report["token_gap_s"]

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    lines = [
        "# Soak across the lab",
        "",
        f"{report['duration_s']:g} s, {report['clients']} concurrent streamed completions of {report['max_tokens']} tokens "
        f"(greedy) through the relay; 6 machines 10-50 ms apart with {LOSS_PCT:g} % loss on every link; "
        f"{sum(e['event'] == 'machine off' for e in report['events'])} machines switched off and back, "
        f"{sum(e['event'] == 'link cut' for e in report['events'])} links cut; "
        f"{report['lost_packets']} packets lost at random, {report['cut_packets']} to cuts.",
        "",
        "| requests | served | equal to reference | refused (429/503) | failed |",
        "|---|---|---|---|---|",
        f"| {report['requests']} | {report['served']} | {report['served_equal_to_reference']} | {report['refused']} | {report['failed']} |",
        "",
    ]
    if report["reasons"]:
        lines += (
            ["| answer | count |", "|---|---|"]
            + [f"| {k} | {v} |" for k, v in sorted(report["reasons"].items())]
            + [""]
        )
    lines += [
        "| | p50 s | p99 s | max s |",
        "|---|---|---|---|",
        f"| time to first token | {s(ft['p50'])} | {s(ft['p99'])} | {s(ft['max'])} |",
        f"| gap between streamed tokens | {s(gap['p50'])} | {s(gap['p99'])} | {s(gap['max'])} |",
        "",
        "RSS of the processes that lived through the run, end of warm-up -> end:",
        "",
        "| process | start MB | end MB | ratio | within 15 % |",
        "|---|---|---|---|---|",
    ]
    for name, h in sorted(report["rss"].items()):
        lines.append(
            f"| {name} | {h['start_mb']:.1f} | {h['end_mb']:.1f} | {h['ratio']:.3f} | {'yes' if h['within'] else 'NO'} |"
        )
    if report["rss_replaced"] or report["rss_new"]:
        lines += [
            "",
            "Not held (gone by the end: switched off, or a worker replaced when its node took another range): "
            + (", ".join(report["rss_replaced"]) or "none")
            + ". New since warm-up: "
            + (", ".join(report["rss_new"]) or "none")
            + ".",
        ]
    lines.append("")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="the soak's length, s (default 600)")
    p.add_argument("--warmup-s", type=float, default=30.0, help="clients without chaos before it, s (default 30)")
    p.add_argument("--clients", type=int, default=16, help="concurrent users (default 16)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens a completion (default 24)")
    p.add_argument("--sequences", type=int, default=8, help="sequences a node's worker holds (default 8)")
    p.add_argument(
        "--kill-every-s", type=float, default=60.0, help="a node machine switched off every this many s (default 60)"
    )
    p.add_argument("--down-s", type=float, default=30.0, help="and brought back after this many s (default 30)")
    p.add_argument("--cut-every-s", type=float, default=120.0, help="a link cut every this many s (default 120)")
    p.add_argument("--cut-s", type=float, default=10.0, help="for this many s (default 10)")
    p.add_argument("--lab-name", default="soak", help="the lab's name (default soak)")
    p.add_argument("--out", type=Path, help="write soak.{json,md} here (default: print only)")
    return p


def main() -> int:
    args = parser().parse_args()
    started = time.perf_counter()
    info = machine_info()
    with tempfile.TemporaryDirectory(prefix="baton-soak-") as tmp:
        report = run_soak(args, Path(tmp))
    report["machine"] = info
    report["wall_time_s"] = time.perf_counter() - started
    publish(args.out, "soak", report, markdown(report))
    ok = report["failed"] == 0 and report["served_equal_to_reference"] == report["served"] and report["rss_all_within"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
