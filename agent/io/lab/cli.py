"""``baton lab``: emulated machines on one host, linked by an emulated WAN (needs root).

    baton lab up --machines N [--delay-ms D] [--jitter-ms J] [--loss PCT] [--rate-mbit R]
                 [--nat NAME,...] [--topology FILE] [--name LAB] [--json]
    baton lab exec [--lab LAB] MACHINE -- CMD ...
    baton lab link [--lab LAB] A B [--delay-ms D] [--jitter-ms J] [--loss PCT] [--rate-mbit R]
                   [--queue-bytes N] [--down | --up] [--one-way]
    baton lab access [--lab LAB] MACHINE [--uplink-mbit R] [--downlink-mbit R]
    baton lab status [--lab LAB] [--json]
    baton lab down [LAB]

``up`` makes machines ``m0``..``m{N-1}`` (or those of ``--topology``), each a network namespace
with one address in 198.18.0.0/15, every pair linked with the given settings; with ``--json``
it prints one line ``{"lab", "machines": [{"name", "netns", "address"}, ...]}`` once all is up.
It stays in the foreground until SIGINT or SIGTERM and removes everything it made on exit; if
it is killed, its guardian removes it, and the next ``up`` sweeps anything left by a crash.

Only argument parsing and printing live here; the steps are ``agent.io.lab.up``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tomllib

from agent import cli_args
from agent.core.lab.topology import LabError, LinkChange, LinkSpec, Topology, full_mesh, parse_topology

__all__ = ["DEFAULT_LAB", "add_arguments", "main"]

DEFAULT_LAB = "lab"
EXIT_USAGE = 2
EXIT_FAILED = 1


def _link_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    default = 0.0 if defaults else None
    shown = " (default 0)" if defaults else " (default: unchanged)"
    parser.add_argument(
        "--delay-ms", type=cli_args.non_negative_float, default=default, metavar="MS",
        help="one-way delay of every link in milliseconds; a round trip is twice it" + shown,
    )  # fmt: skip
    parser.add_argument(
        "--jitter-ms", type=cli_args.non_negative_float, default=default, metavar="MS",
        help="each packet's delay varies by up to this many milliseconds either way, order kept" + shown,
    )  # fmt: skip
    parser.add_argument(
        "--loss", type=cli_args.non_negative_float, default=default, metavar="PCT",
        help="percent of packets each link drops at random, 0-100" + shown,
    )  # fmt: skip
    parser.add_argument(
        "--rate-mbit", type=cli_args.non_negative_float, default=default, metavar="MBIT",
        help="bandwidth of each link and direction in Mbit/s, 0: unlimited" + shown,
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="lab_command", required=True, metavar="LAB_COMMAND")

    up = commands.add_parser(
        "up",
        help="make the machines and links, stay until SIGINT/SIGTERM, then remove them",
        description="Make the lab's machines (network namespaces, one address each in 198.18.0.0/15) and the links between them, print them, stay in the foreground until SIGINT or SIGTERM, then remove everything.",
    )
    up.add_argument("--machines", type=cli_args.positive_int, metavar="N", help="machines m0..m{N-1}, fully meshed")
    up.add_argument("--topology", metavar="FILE", help="a TOML topology file (agent/core/lab/topology.py)")
    _link_options(up, defaults=True)
    up.add_argument(
        "--nat", default="", metavar="NAME,...",
        help="machines behind a NAT-like filter: inbound only on flows they opened (default: none)",
    )  # fmt: skip
    up.add_argument(
        "--name", default=DEFAULT_LAB, help=f"the lab's name (default {DEFAULT_LAB}); labs of different names coexist"
    )
    up.add_argument(
        "--seed", type=cli_args.non_negative_int, default=1, help="seed of the loss and jitter draws (default 1)"
    )
    up.add_argument("--json", action="store_true", help="print one JSON line once the lab is up")

    run = commands.add_parser(
        "exec",
        help="run a command inside a machine",
        description="Run a command inside a machine of a running lab: its network is the machine's (BATON_LAB_MACHINE and BATON_LAB_ADDRESS are set).",
    )
    run.add_argument("--lab", default=DEFAULT_LAB, help=f"the lab (default {DEFAULT_LAB})")
    run.add_argument("machine", help="the machine's name")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command and its arguments")

    link = commands.add_parser(
        "link",
        help="change a link while the lab runs (both directions unless --one-way)",
        description="Change a link of a running lab: delay, jitter, loss, rate, cut or heal; both directions unless --one-way.",
    )
    link.add_argument("--lab", default=DEFAULT_LAB, help=f"the lab (default {DEFAULT_LAB})")
    link.add_argument("a", help="a machine")
    link.add_argument("b", help="another machine")
    _link_options(link, defaults=False)
    link.add_argument(
        "--queue-bytes", type=cli_args.non_negative_int, metavar="N", help="bytes that may wait for the rate"
    )
    state = link.add_mutually_exclusive_group()
    state.add_argument("--down", action="store_true", help="cut the link (every packet dropped)")
    state.add_argument("--up", action="store_true", help="heal a cut link")
    link.add_argument("--one-way", action="store_true", help="change only A -> B")

    access = commands.add_parser(
        "access",
        help="set a machine's access link (its uplink and downlink) while the lab runs",
        description="Set a machine's access link: the bandwidth into and out of it, shared by all its links.",
    )
    access.add_argument("--lab", default=DEFAULT_LAB, help=f"the lab (default {DEFAULT_LAB})")
    access.add_argument("machine", help="the machine")
    access.add_argument(
        "--uplink-mbit", type=cli_args.non_negative_float, default=0.0, metavar="MBIT",
        help="bandwidth out of the machine in Mbit/s, shared by all its links (default 0: unlimited)",
    )  # fmt: skip
    access.add_argument(
        "--downlink-mbit", type=cli_args.non_negative_float, default=0.0, metavar="MBIT",
        help="bandwidth into the machine in Mbit/s, shared by all its links (default 0: unlimited)",
    )  # fmt: skip

    status = commands.add_parser(
        "status",
        help="a running lab's machines and each link's counters",
        description="A running lab's machines and, for each link, its settings and what the forwarder counted: packets, losses, queue drops.",
    )
    status.add_argument("--lab", default=DEFAULT_LAB, help=f"the lab (default {DEFAULT_LAB})")
    status.add_argument("--json", action="store_true", help="print one JSON object")

    down = commands.add_parser(
        "down",
        help="remove a lab (a running one is stopped; a stale one swept)",
        description="Remove a lab: a running one is asked to stop (SIGTERM, then SIGKILL), what is left of a crashed one is swept.",
    )
    down.add_argument("lab", nargs="?", default=DEFAULT_LAB, help=f"the lab (default {DEFAULT_LAB})")


def _topology(args: argparse.Namespace) -> Topology:
    if args.topology and args.machines:
        raise LabError("give --machines or --topology, not both")
    if args.topology:
        try:
            with open(args.topology, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise LabError(f"--topology {args.topology}: {err}") from None
        return parse_topology(data)
    if not args.machines:
        raise LabError("give --machines N (or --topology FILE)")
    link = LinkSpec(delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, loss_pct=args.loss, rate_mbit=args.rate_mbit)
    nat = [n.strip() for n in args.nat.split(",") if n.strip()]
    return full_mesh(args.machines, link, nat)


def _up(args: argparse.Namespace) -> int:
    from .up import bring_up

    topology = _topology(args)
    # Signals wait until the lab is whole, then end it in order (never half made, half removed).
    stop_signals = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    lab = bring_up(args.name, topology, seed=args.seed)
    try:
        machines = [{"name": m.name, "netns": m.netns, "address": m.address} for m in lab.record.machines]
        if args.json:
            print(json.dumps({"lab": args.name, "machines": machines}), flush=True)
        else:
            for m in machines:
                nat = " (behind NAT)" if topology.machines[topology.index(m["name"])].nat else ""
                print(f"{m['name']}  {m['address']}  netns {m['netns']}{nat}", flush=True)
            print(f"lab {args.name} is up; Ctrl-C (or SIGTERM) removes it", flush=True)
        received = signal.sigwait(stop_signals)
        print(f"lab {args.name}: {signal.Signals(received).name}, removing it", file=sys.stderr, flush=True)
    finally:
        lab.tear_down()
    return 0


def _record(lab: str):
    from .state import live_record

    record = live_record(lab)
    if record is None:
        raise LabError(f"no lab {lab} is running (start one with `baton lab up --name {lab} ...`)")
    return record


def _exec(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise LabError("give the command after --: baton lab exec MACHINE -- CMD ...")
    machine = _record(args.lab).machine(args.machine)
    env = {**os.environ, "BATON_LAB": args.lab, "BATON_LAB_MACHINE": machine.name, "BATON_LAB_ADDRESS": machine.address}
    os.execvpe("ip", ["ip", "netns", "exec", machine.netns, *argv], env)
    return EXIT_FAILED  # not reached


def _link(args: argparse.Namespace) -> int:
    from .up import change_link

    up = True if args.up else False if args.down else None
    change = LinkChange(args.delay_ms, args.jitter_ms, args.loss, args.rate_mbit, args.queue_bytes, up)
    change_link(_record(args.lab), args.a, args.b, change, both_ways=not args.one_way)
    return 0


def _access(args: argparse.Namespace) -> int:
    from .up import change_access

    change_access(_record(args.lab), args.machine, args.uplink_mbit, args.downlink_mbit)
    return 0


def _status(args: argparse.Namespace) -> int:
    from .forwarder import stats

    record = _record(args.lab)
    counters = stats(record.control_path)
    if args.json:
        machines = [{"name": m.name, "netns": m.netns, "address": m.address} for m in record.machines]
        print(
            json.dumps({"lab": record.name, "owner_pid": record.owner_pid, "machines": machines, "forwarder": counters})
        )
        return 0
    names = [m.name for m in record.machines]
    print(
        f"lab {record.name} (owner pid {record.owner_pid}), forwarder cpu {counters['cpu_user_s'] + counters['cpu_system_s']:.2f} s"
    )
    for m in record.machines:
        print(f"  {m.name:<10} {m.address:<15} {m.netns}")
    print(
        f"  {'link':<20} {'delay ms':>8} {'loss %':>7} {'Mbit/s':>7} {'up':>3} {'packets':>9} {'lost':>6} {'queue':>6}"
    )
    for row in counters["links"]:
        a, b = names[row["src"]], names[row["dst"]]
        print(
            f"  {a + ' -> ' + b:<20} {row['delay_us'] / 1000:>8g} {row['loss'] * 100:>7g} {row['rate_bps'] / 1e6:>7g}"
            f" {'yes' if row['up'] else 'no':>3} {row['packets']:>9} {row['drop_loss']:>6} {row['drop_queue']:>6}"
        )
    return 0


def _down(args: argparse.Namespace) -> int:
    from .state import read_record, sweep_lab
    from .up import stop_owner

    record = read_record(args.lab)
    if record is not None:
        stop_owner(record)
    swept = sweep_lab(args.lab)
    print(f"lab {args.lab}: removed" + (f" ({', '.join(swept)})" if swept else ""), flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    from .netns import LabSetupError

    run = {"up": _up, "exec": _exec, "link": _link, "access": _access, "status": _status, "down": _down}[
        args.lab_command
    ]
    try:
        return run(args)
    except LabError as err:
        print(f"baton lab {args.lab_command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except LabSetupError as err:
        print(f"baton lab {args.lab_command}: {err}", file=sys.stderr)
        return EXIT_FAILED
