"""The hops' prefix caches and prefix-aware routes (``--prefix-cache-bytes``), in one run:

- ``ttft``: with a shared system prompt of ``--system-tokens`` tokens (1,500), a new session's
  time to first token against the first session's (the same system prompt, another question),
  on loopback (a tracker and 3 nodes of SmolLM2) and on the lab at ``--rtt-ms`` (20 ms: the
  owner, the tracker and the nodes each a machine; needs root). Each turn a fresh system
  prompt (nothing cached), ``--turns`` turns; the figure is the client's ``first_token_s``.
  Target: the new session's median <= 0.15x the first's.
- ``conversation``: a ``--conversation-turns``-turn (10) chat through the demo's relay with the
  ``openai`` client, each turn's messages the previous turn's plus its answer and a new
  question: the prompt rows the nodes' workers computed (their ``forward_rows``, less one
  decode row per generated token after the first), summed over the turns, over the
  conversation's unique tokens (its last prompt and answer), with the cache and without it
  (nodes without ``--prefix-cache-bytes``). Target: <= 1.2x with the cache (ten equal turns
  without it: 5.5x).
- ``hits``: ``--conversations`` (16) conversations sharing ``--system-prompts`` (4) system
  prompts on a 6-node swarm (two copies of each third of the model), ``--hit-turns`` turns
  each, ``--parallel`` at once, through the swarm client: the share of sessions after each
  conversation's first turn that copied a cached prefix (and the share of their prompt tokens
  copied). Target: >= 90 %.

``--quick``: a smoke run (short prompts and conversations, one turn; no targets checked).
Pure report parts (``summarise_*``, ``markdown``) are tested in tests/test_bench_prefix.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
from pathlib import Path

import _bootstrap  # noqa: F401  (first: it makes the project importable)
import trio
from common import log, publish, stamped

ALIAS = "smollm2"
CACHE_BYTES = 256 << 20
TARGET_TTFT_RATIO = 0.15
TARGET_CONVERSATION_RATIO = 1.2
TARGET_HIT_RATE = 0.9
SYSTEM_TEXT = (
    "You are the assistant of a volunteer computing project. Volunteers lend their machines to run "
    "language models that are too large for any one of them: each machine holds a contiguous range of "
    "the model's layers and passes the hidden state to the next. Machines join and leave without "
    "warning, links are slow and lossy, and every answer must be the same as one machine's would be. "
    "Answer questions about the project briefly and precisely, name the part of the system involved, "
    "and say what a volunteer or an operator can do about it. "
)
QUESTIONS = (
    "How does a new machine join the swarm?",
    "What happens when a machine disappears in the middle of an answer?",
    "Why are prompts split into chunks?",
    "How is the hidden state protected on the wire?",
    "What does the tracker decide, and what does it never see?",
    "How are sessions batched together?",
    "What is the relay for?",
    "How are API keys and quotas kept?",
    "Why are some prompts answered faster than others?",
    "How does a volunteer see what their machine did?",
    "What is a recipe?",
    "How is a wrong answer from a machine caught?",
)


# --- pure report parts ----------------------------------------------------------------------


def summarise_ttft(turns: list[dict]) -> dict:
    """Medians of the first and the new sessions' time to first token, and their ratio."""
    first = statistics.median(t["first_s"] for t in turns)
    new = statistics.median(t["new_s"] for t in turns)
    return {
        "first_s": first, "new_s": new, "ratio": new / first if first > 0 else None,
        "cached_tokens": [t["new_cached_tokens"] for t in turns],
        "met": first > 0 and new / first <= TARGET_TTFT_RATIO,
    }  # fmt: skip


def summarise_conversation(turns: list[dict]) -> dict:
    """Prompt rows the nodes computed over the conversation's unique tokens. Each turn:
    ``rows`` (one hop's Forward rows during it), ``prompt_tokens``, ``completion_tokens``."""
    prefilled = sum(t["rows"] - max(t["completion_tokens"] - 1, 0) for t in turns)
    unique = turns[-1]["prompt_tokens"] + turns[-1]["completion_tokens"] if turns else 0
    return {
        "prefilled_rows": prefilled, "unique_tokens": unique, "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "ratio": prefilled / unique if unique else None,
    }  # fmt: skip


def summarise_hits(sessions: list[dict]) -> dict:
    """Hit rates of the sessions after each conversation's first turn (``turn`` >= 1), and of
    first turns (a system prompt another conversation used before)."""

    def rates(chosen: list[dict]) -> dict:
        prompt = sum(s["prompt_tokens"] for s in chosen)
        return {
            "sessions": len(chosen),
            "session_hit_rate": sum(s["cached_tokens"] > 0 for s in chosen) / len(chosen) if chosen else None,
            "token_hit_rate": sum(s["cached_tokens"] for s in chosen) / prompt if prompt else None,
        }

    later = rates([s for s in sessions if s["turn"] >= 1])
    rate = later["session_hit_rate"]
    return {
        "later_turns": later, "first_turns": rates([s for s in sessions if s["turn"] == 0]),
        "met": rate is not None and rate >= TARGET_HIT_RATE,
    }  # fmt: skip


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def markdown(report: dict) -> str:
    lines = ["# Prefix caches and prefix-aware routes", ""]
    if "measured_at" in report:
        m = report["machine"]
        lines += [f"Measured {report['measured_at']}, {m['cpu_model']}, {m['cores']} cores; SmolLM2.", ""]
    if "chunk_tokens" in report:
        lines += [f"The owners' prompt chunks and prefix blocks (the relay's too): {report['chunk_tokens']} tokens"
                  " (a copied prefix ends on a chunk boundary).", ""]  # fmt: skip
    if report.get("quick"):
        lines += ["**A smoke run (`--quick`): sizes reduced, targets not checked.**", ""]
    for name, section in report.get("ttft", {}).items():
        s = section["summary"]
        lines += [
            f"## Time to first token with a shared {section['system_tokens']}-token system prompt ({name})", "",
            "| turn | first session s | new session s | new: cached tokens |", "|---|---|---|---|",
            *(f"| {i + 1} | {t['first_s']:.3f} | {t['new_s']:.3f} | {t['new_cached_tokens']} |"
              for i, t in enumerate(section["turns"])),
            "", f"Medians: the new session **{_ratio(s['ratio'])}** the first's (target <= {TARGET_TTFT_RATIO}x: "
            f"{'met' if s['met'] else 'missed'}).", "",
        ]  # fmt: skip
    if "conversation" in report:
        c = report["conversation"]
        lines += [
            f"## A {c['turns']}-turn conversation through the relay", "",
            "| cache | prompt rows computed | unique tokens | ratio |", "|---|---|---|---|",
        ]  # fmt: skip
        for name in ("on", "off"):
            if name in c:
                s = c[name]["summary"]
                lines.append(f"| {name} | {s['prefilled_rows']} | {s['unique_tokens']} | {_ratio(s['ratio'])} |")
        on = c.get("on", {}).get("summary", {}).get("ratio")
        met = on is not None and on <= TARGET_CONVERSATION_RATIO
        lines += ["", f"Target with the cache: <= {TARGET_CONVERSATION_RATIO}x ({'met' if met else 'missed'}).", ""]
    if "hits" in report:
        h = report["hits"]
        s = h["summary"]
        lines += [
            f"## Hit rate: {h['conversations']} conversations, {h['system_prompts']} system prompts, "
            f"{h['nodes']} nodes (two copies of every range)", "",
            "| sessions | count | sessions that copied a prefix | prompt tokens copied |", "|---|---|---|---|",
            f"| after each conversation's first turn | {s['later_turns']['sessions']} | "
            f"{_rate(s['later_turns']['session_hit_rate'])} | {_rate(s['later_turns']['token_hit_rate'])} |",
            f"| first turns | {s['first_turns']['sessions']} | {_rate(s['first_turns']['session_hit_rate'])} | "
            f"{_rate(s['first_turns']['token_hit_rate'])} |",
            "", f"Target: >= {100 * TARGET_HIT_RATE:.0f} % of the later sessions ({'met' if s['met'] else 'missed'}).", "",
        ]  # fmt: skip
    return "\n".join(lines)


# --- measuring ------------------------------------------------------------------------------


def worker_rows(swarm) -> int:
    """Forward rows of every worker of every node of ``swarm`` since they started."""
    return sum(health.forward_rows for _, health in swarm.worker_health())


async def _idle(swarm) -> None:
    """Until no worker holds a session's sequence (their caches kept the blocks by then)."""

    def active() -> int:
        return sum(health.active_sequences for _, health in swarm.worker_health())

    with trio.fail_after(60):
        while await trio.to_thread.run_sync(active):
            await trio.sleep(0.05)


async def _heard_twice(client) -> None:
    """Until every node sent two more heartbeats (the tracker's node list): the later one names
    what its workers' caches held after the caller's wait (as a user's next turn, seconds
    later, finds it)."""

    async def heard() -> dict[str, int]:
        return {n.peer_id: n.last_heartbeat_ms for n in await client.list_nodes() if n.alive}

    seen = {p: {ms} for p, ms in (await heard()).items()}
    with trio.fail_after(30):
        while any(len(times) <= 2 for times in seen.values()):
            await trio.sleep(0.1)
            for p, ms in (await heard()).items():
                seen.setdefault(p, set()).add(ms)


async def _client(swarm, stack: contextlib.AsyncExitStack, args: argparse.Namespace, listen_addrs=None):
    """The tracker started and a client of it (closed with ``stack``): (client, model entry)."""
    from agent.io.client import SwarmClientConfig, open_swarm_client

    await swarm.start_tracker()
    # (a cached prefix ends on a chunk boundary: the chunk size bounds what a session copies)
    config = SwarmClientConfig(prefill_chunk_tokens=args.chunk_tokens, prefix_block_tokens=args.chunk_tokens)
    extra = {} if listen_addrs is None else {"listen_addrs": listen_addrs}
    client = await stack.enter_async_context(open_swarm_client(swarm.tracker_addr, config=config, **extra))
    (entry,) = [m for m in await client.list_models() if m.alias == ALIAS]
    return client, entry


async def measure_ttft(swarm, args: argparse.Namespace, listen_addrs=None, set_rtt=None) -> dict:
    """Section ``ttft`` on ``swarm`` (not started); ``set_rtt()`` puts the links' delay in place."""
    from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage

    async with contextlib.AsyncExitStack() as stack:
        client, entry = await _client(swarm, stack, args, listen_addrs)
        memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, 3)
        for i in range(3):
            swarm.start_node(f"node-{i + 1}", memory, ["--prefix-cache-bytes", str(CACHE_BYTES)])
        route = await wait_for_coverage(client, swarm, ALIAS, timeout_s=300.0)
        system, stop = await client.tokenize(route, SYSTEM_TEXT * 20)
        questions = [(await client.tokenize(route, f" {q}"))[0][1:] for q in QUESTIONS[:2]]
        if set_rtt is not None:
            set_rtt()
        await client.generate_tokens(ALIAS, system[:200], max_tokens=2, stop_tokens=stop)  # warm
        turns = []
        for turn in range(args.turns):
            marker = (await client.tokenize(route, f"Session {turn}."))[0]
            prompt = (marker + system[1:])[: args.system_tokens]  # a system prompt no cache holds yet
            first = await client.generate_tokens(ALIAS, prompt + questions[0], max_tokens=2, stop_tokens=stop)
            await _idle(swarm)
            new = await client.generate_tokens(ALIAS, prompt + questions[1], max_tokens=2, stop_tokens=stop)
            await _idle(swarm)
            turns.append({"first_s": first.first_token_s, "new_s": new.first_token_s,
                          "first_cached_tokens": first.cached_tokens, "new_cached_tokens": new.cached_tokens})  # fmt: skip
            log(f"ttft turn {turn + 1}: first {first.first_token_s:.3f} s, new {new.first_token_s:.3f} s "
                f"({new.cached_tokens} cached)")  # fmt: skip
    return {"system_tokens": args.system_tokens, "turns": turns, "summary": summarise_ttft(turns)}


def _local_config(**fields):
    from agent.harness.local_swarm import LocalSwarmConfig
    from agent.models import model_path

    return LocalSwarmConfig(model_path=model_path(ALIAS), model_alias=ALIAS, **fields)


async def ttft_loopback(args: argparse.Namespace) -> dict:
    from agent.harness.local_swarm import open_local_swarm

    async with open_local_swarm(_local_config(threads=args.threads)) as swarm:
        return await measure_ttft(swarm, args)


def ttft_lab(args: argparse.Namespace) -> dict:
    """Section ``ttft`` on the lab (``bench/wan.py``'s machines), links at ``--rtt-ms``."""
    import tempfile

    import wan

    from agent.core.lab.topology import LinkChange, LinkSpec, MachineSpec, Topology
    from agent.harness.local_swarm import LocalSwarm, Placement
    from agent.io.lab.harness import running_lab

    topology = Topology(tuple(MachineSpec(m) for m in wan.MACHINES), LinkSpec())
    with running_lab(topology, "prefix") as lab, tempfile.TemporaryDirectory(prefix="baton-prefix-") as workdir:
        machines = {"tracker": "tracker", **{f"node-{i + 1}": wan.NODES[i] for i in range(3)}}
        swarm = LocalSwarm(_local_config(threads=args.threads, placement=Placement(lab, machines)), Path(workdir))
        try:
            section = lab.trio_run_in(
                "owner", measure_ttft, swarm, args, lab.listen_addrs("owner"),
                lambda: wan.set_every_link(lab, LinkChange(delay_ms=args.rtt_ms / 2)),
            )  # fmt: skip
        finally:
            swarm.close_nowait()
    section["rtt_ms"] = args.rtt_ms
    return section


def _chat(url: str, api_key: str, messages: list[dict], max_tokens: int) -> tuple[str, int, int]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=900)
    reply = client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=max_tokens, temperature=0)  # type: ignore[arg-type]
    assert reply.usage is not None
    return reply.choices[0].message.content or "", reply.usage.prompt_tokens, reply.usage.completion_tokens


async def measure_conversation(args: argparse.Namespace, cache: bool) -> dict:
    """One conversation through the demo's relay (3 nodes), the nodes' caches on or off."""
    from agent.demo.swarm_demo import demo_swarm_config, open_demo_relay

    config = demo_swarm_config(threads=args.threads)
    # (no spot checks: a replayed session's rows would count)
    relay_args = (*config.relay_args, "--spot-check-rate", "0", "--prefill-chunk-tokens", str(args.chunk_tokens),
                  "--prefix-block-tokens", str(args.chunk_tokens))  # fmt: skip
    config = dataclasses.replace(config, relay_args=relay_args)
    if cache:
        config = dataclasses.replace(config, node_args=(*config.node_args, "--prefix-cache-bytes", str(CACHE_BYTES)))
    turns = []
    async with open_demo_relay(config) as (swarm, url, api_key):
        messages = [{"role": "system", "content": SYSTEM_TEXT * args.system_repeat}]
        for turn in range(args.conversation_turns):
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            before = await trio.to_thread.run_sync(worker_rows, swarm)
            answer, prompt_tokens, completion_tokens = await trio.to_thread.run_sync(
                _chat, url, api_key, messages, args.answer_tokens
            )
            await _idle(swarm)
            rows = (await trio.to_thread.run_sync(worker_rows, swarm) - before) / 3  # (3 hops: one hop's rows)
            messages.append({"role": "assistant", "content": answer})
            turns.append({"rows": rows, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens})
            log(f"conversation (cache {'on' if cache else 'off'}) turn {turn + 1}: {prompt_tokens} prompt tokens, "
                f"{rows:.0f} rows a hop")  # fmt: skip
    return {"turns": turns, "summary": summarise_conversation(turns)}


async def measure_hits(args: argparse.Namespace) -> dict:
    """Section ``hits``: 6 nodes of a third of the model each, conversations through the client."""
    from agent.demo.swarm_demo import wait_for_copies, wait_for_coverage
    from agent.harness.local_swarm import open_local_swarm

    sessions: list[dict] = []
    # room for --parallel sessions on one route beside another owner's share (--owner-max-share)
    config = _local_config(threads=args.threads, max_sequences=2 * args.parallel)
    async with open_local_swarm(config) as swarm, contextlib.AsyncExitStack() as stack:
        client, entry = await _client(swarm, stack, args)
        blocks_each = -(-entry.n_layer // 3)
        memory = blocks_each * entry.bytes_per_block + entry.bytes_per_block // 2
        for i in range(6):
            swarm.start_node(f"node-{i + 1}", memory, ["--prefix-cache-bytes", str(2 * CACHE_BYTES)])
        route = await wait_for_coverage(client, swarm, ALIAS, timeout_s=300.0)
        await wait_for_copies(client, swarm, 2, timeout_s=300.0)
        system, stop = await client.tokenize(route, SYSTEM_TEXT * args.system_repeat)
        systems = [
            (await client.tokenize(route, f"Assistant number {k}."))[0] + system[1:] for k in range(args.system_prompts)
        ]
        questions = [(await client.tokenize(route, f" {q}"))[0][1:] for q in QUESTIONS]
        prompts = [list(systems[c % len(systems)]) for c in range(args.conversations)]
        limit = trio.Semaphore(args.parallel)

        async def turn_of(conversation: int, turn: int) -> None:
            async with limit:
                prompt = prompts[conversation] + questions[(conversation + turn) % len(questions)]
                result = await client.generate_tokens(ALIAS, prompt, max_tokens=args.answer_tokens, stop_tokens=stop)
                prompts[conversation] = prompt + list(result.tokens)
                sessions.append({"conversation": conversation, "turn": turn, "prompt_tokens": len(prompt),
                                 "cached_tokens": result.cached_tokens,
                                 "route": [h["node"] for h in result.route]})  # fmt: skip

        for turn in range(args.hit_turns):
            async with trio.open_nursery() as nursery:
                for conversation in range(args.conversations):
                    nursery.start_soon(turn_of, conversation, turn)
            await _idle(swarm)
            await _heard_twice(client)
            log(f"hits: turn {turn + 1} of {args.conversations} conversations done")
    return {
        "conversations": args.conversations, "system_prompts": args.system_prompts, "nodes": 6,
        "sessions": sessions, "summary": summarise_hits(sessions),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("ttft", "lab", "conversation", "hits"), action="append",
                        help="run only these sections (repeatable; default: all; lab: ttft on the lab)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a smoke run: reduced sizes, one turn")
    parser.add_argument("--turns", type=int, default=5, help="ttft turns (default 5)")
    parser.add_argument("--system-tokens", type=int, default=1500, help="the shared system prompt (default 1500)")
    parser.add_argument("--rtt-ms", type=float, default=20.0, help="the lab's RTT (default 20)")
    parser.add_argument("--conversation-turns", type=int, default=10, help="turns of the relay conversation (10)")
    parser.add_argument("--answer-tokens", type=int, default=32, help="tokens of each answer (default 32)")
    parser.add_argument("--system-repeat", type=int, default=3, help="system text repeats in chats (default 3)")
    parser.add_argument("--conversations", type=int, default=16, help="hits: conversations (default 16)")
    parser.add_argument("--system-prompts", type=int, default=4, help="hits: system prompts (default 4)")
    parser.add_argument("--hit-turns", type=int, default=3, help="hits: turns of each conversation (default 3)")
    parser.add_argument("--parallel", type=int, default=4, help="hits: conversations at once (default 4)")
    parser.add_argument("--threads", type=int, default=1, help="threads per worker (default 1)")
    from agent.io.client import SwarmClientConfig

    default_chunk = SwarmClientConfig().prefill_chunk_tokens
    parser.add_argument("--chunk-tokens", type=int, default=default_chunk,
                        help=f"the owners' prefill_chunk_tokens and prefix_block_tokens, the relay's too (default {default_chunk}, the "
                             "owner's default; a copied prefix ends on a chunk boundary)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="write prefix.{json,md} here (bench/results)")
    args = parser.parse_args()
    if args.quick:
        args.turns, args.system_tokens, args.conversation_turns, args.answer_tokens = 1, 300, 2, 8
        args.conversations, args.system_prompts, args.hit_turns, args.system_repeat = 4, 2, 2, 1
    only = set(args.only or ("ttft", "lab", "conversation", "hits"))
    report: dict = {"quick": args.quick, "chunk_tokens": args.chunk_tokens, "ttft": {}}
    if "ttft" in only:
        report["ttft"]["loopback"] = trio.run(ttft_loopback, args)
    if "lab" in only:
        if os.geteuid() != 0:
            print("the lab needs root: skipping the lab's ttft (run with sudo)", file=sys.stderr)
        else:
            report["ttft"][f"lab at {args.rtt_ms:g} ms RTT"] = ttft_lab(args)
    if "conversation" in only:
        report["conversation"] = {"turns": args.conversation_turns}
        for name, cache in (("on", True), ("off", False)):
            report["conversation"][name] = trio.run(measure_conversation, args, cache)
    if "hits" in only:
        report["hits"] = trio.run(measure_hits, args)
    publish(args.out, "prefix", stamped(report), markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
