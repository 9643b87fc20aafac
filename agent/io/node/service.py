"""``baton node install | uninstall | status | doctor``: a volunteer's node as a per-user service.

  baton node install --tracker MULTIADDR [--memory-bytes N] [--backend auto|cpu|cuda|hip|vulkan|metal]
                     [--relay] [--listen MULTIADDR] [--models-dir DIR] [--key PATH] [--no-build] [--no-start]
  baton node uninstall
  baton node status [--json]
  baton node doctor [--tracker MULTIADDR] [--key PATH] [--models-dir DIR]

``install`` detects the GPU backend (``agent.core.node.install.detect_backend`` over what
``nvidia-smi -L``, ``rocminfo`` and ``vulkaninfo --summary`` print), builds the worker for it
through this checkout's Makefile (``make llama native`` with the backend's CMake flags into
``build/native[-BACKEND]``: ccache and the existing build make a rebuild cheap; a progress bar
follows the build's percentages, the full log goes to ``<config dir>/build-BACKEND.log``),
creates the node key (owner-only), writes ``<config dir>/node.json`` and installs a per-user
service running ``baton node --models-dir ...`` that starts at login (at boot with
``loginctl enable-linger``) and restarts on failure: a systemd user unit
``~/.config/systemd/user/baton-node.service`` on Linux, a launchd agent
``~/Library/LaunchAgents/org.baton.node.plist`` on macOS. What cannot be done is said with the
fix (exit 2).

Paths: config dir ``$XDG_CONFIG_HOME/baton`` (default ``~/.config/baton``: ``node.key``,
``node.json``), models ``$XDG_DATA_HOME/baton/models`` (default ``~/.local/share/...``).

Only I/O lives here (running tools, files, the service manager, asking the tracker); every
decision is ``agent.core.node.install``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from agent.core.node.install import (
    BACKENDS,
    CannotInstall,
    Check,
    HostTools,
    build_plan,
    check_backend,
    check_dialable,
    check_disk,
    check_key,
    check_tracker,
    check_worker,
    detect_backend,
    launchd_plist,
    render_checks,
    systemd_unit,
)
from agent.runtime import REPO_ROOT

__all__ = ["add_subcommands", "gather_tools", "main", "service_paths"]

UNIT_NAME = "baton-node.service"
LAUNCHD_LABEL = "org.baton.node"
TOOLS = ("nvidia-smi", "nvcc", "rocminfo", "hipcc", "vulkaninfo", "glslc", "systemctl", "launchctl", "cmake", "make")
TOOL_TIMEOUT_S = 20.0
TRACKER_TIMEOUT_S = 10.0
EXIT_CANNOT = 2


@dataclasses.dataclass(frozen=True)
class ServicePaths:
    config_dir: Path
    models_dir: Path
    unit_path: Path  # the systemd unit or the launchd plist

    @property
    def key_path(self) -> Path:
        return self.config_dir / "node.key"

    @property
    def config_path(self) -> Path:
        return self.config_dir / "node.json"


def service_paths(system: str | None = None) -> ServicePaths:
    home = Path.home()
    config = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    data = Path(os.environ.get("XDG_DATA_HOME") or home / ".local" / "share")
    if (system or platform.system()) == "Darwin":
        unit = home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
    else:
        unit = config / "systemd" / "user" / UNIT_NAME
    return ServicePaths(config / "baton", data / "baton" / "models", unit)


def add_subcommands(parser: argparse.ArgumentParser) -> None:
    """``install``, ``uninstall``, ``status`` and ``doctor`` under the ``node`` parser."""
    from agent import cli_args

    commands = parser.add_subparsers(dest="node_command", metavar="COMMAND")
    install = commands.add_parser("install", help="build the worker for this GPU and install the node as a service")
    install.add_argument("--tracker", required=True, help="the tracker's multiaddr, ending /p2p/<peer id>")
    install.add_argument(
        "--memory-bytes", type=cli_args.positive_int, metavar="N", help="memory offered (default: available RAM)"
    )
    install.add_argument(
        "--backend", default="auto", choices=("auto", *BACKENDS), help="GPU backend (default: detected)"
    )
    install.add_argument("--relay", action="store_true", help="be reached through the tracker's relay (behind NAT)")
    install.add_argument("--listen", help="the node's listen multiaddr (default: baton node's)")
    install.add_argument("--models-dir", help="where assigned ranges are fetched to (default: XDG data dir)")
    install.add_argument("--key", help="the node key (default: <config dir>/node.key; created owner-only)")
    install.add_argument("--no-build", action="store_true", help="use the worker already built for the backend")
    install.add_argument("--no-start", action="store_true", help="write the service, do not enable or start it")
    commands.add_parser("uninstall", help="stop and remove the service (keeps the key and fetched models)")
    status = commands.add_parser("status", help="the service, the admission and the served ranges")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    doctor = commands.add_parser("doctor", help="check every requirement, with the fix for each failure")
    doctor.add_argument("--tracker", help="the tracker (default: the installed node's)")
    doctor.add_argument("--key", help="the node key (default: the installed node's)")
    doctor.add_argument("--models-dir", help="where models are fetched to (default: the installed node's)")


def main(args: argparse.Namespace) -> int:
    command = args.node_command
    try:
        if command == "install":
            return install(args)
        if command == "uninstall":
            return uninstall(args)
        if command == "status":
            return status(args)
        return doctor(args)
    except CannotInstall as error:
        print(f"baton node {command}: {error.problem}\n  fix: {error.fix}", file=sys.stderr)
        return EXIT_CANNOT


# --- facts ------------------------------------------------------------------------------------------


def _output(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def gather_tools() -> HostTools:
    """What this machine has: the tools on PATH and what the GPU tools print."""
    on_path = frozenset(t for t in TOOLS if shutil.which(t))
    return HostTools(
        system=platform.system(),
        machine=platform.machine(),
        on_path=on_path,
        nvidia_smi_output=_output(["nvidia-smi", "-L"]) if "nvidia-smi" in on_path else "",
        rocminfo_output=_output(["rocminfo"]) if "rocminfo" in on_path else "",
        vulkaninfo_output=_output(["vulkaninfo", "--summary"]) if "vulkaninfo" in on_path else "",
    )


def _read_config(paths: ServicePaths) -> dict:
    try:
        return json.loads(paths.config_path.read_text())
    except (OSError, ValueError):
        return {}


# --- install ----------------------------------------------------------------------------------------


def build_worker(plan, log_path: Path, *, show_progress: bool | None = None) -> Path:
    """``make llama native`` for ``plan`` in this checkout, a progress bar following the
    build's ``[ NN%]`` lines; returns the binary.

    Raises:
      CannotInstall: the build failed (the log's tail and path say why).
    """
    from tqdm import tqdm

    if shutil.which("make") is None or shutil.which("cmake") is None:
        raise CannotInstall(
            "building the worker needs make and cmake", "sudo apt-get install build-essential cmake (or run make deps)"
        )
    argv = ["make", "-C", str(REPO_ROOT), "--no-print-directory", "llama", "native",
            f"NATIVE_BUILD={plan.build_dir}", f"CMAKE_ARGS={plan.cmake_args_text}"]  # fmt: skip
    log_path.parent.mkdir(parents=True, exist_ok=True)
    show = sys.stderr.isatty() if show_progress is None else show_progress
    bar = tqdm(total=100, unit="%", desc=f"building the {plan.backend} worker", file=sys.stderr, disable=not show)
    percent = re.compile(rb"^\[\s*(\d+)%\]")
    with open(log_path, "wb") as log, bar:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            m = percent.match(line)
            if m and int(m.group(1)) > bar.n:
                bar.update(int(m.group(1)) - bar.n)
        code = process.wait()
        if code == 0:
            bar.update(100 - bar.n)
    if code != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise CannotInstall(
            f"the {plan.backend} worker build failed (exit {code}):\n    " + "\n    ".join(tail),
            f"read {log_path}; run `make deps` for missing packages, or try --backend cpu",
        )
    binary = REPO_ROOT / plan.build_dir / "baton-worker"
    if not os.access(binary, os.X_OK):
        raise CannotInstall(f"the build made no {binary}", f"read {log_path}")
    return binary


def node_argv(config: dict) -> list[str]:
    """The service's ``baton node`` command line, its flags rendered from the ``NodeConfig`` of
    the installed settings (``install`` writes them)."""
    from agent.io.settings import to_argv

    from .config import NodeConfig

    settings = NodeConfig(
        tracker=config["tracker"], key_file=config["key"], models_dir=config["models_dir"],
        memory_bytes=config.get("memory_bytes") or None, listen=config.get("listen") or NodeConfig.listen,
        relay=bool(config.get("relay")),
    )  # fmt: skip
    return [sys.executable, "-m", "agent.cli", "node", *to_argv(settings)]


def _systemctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemctl", "--user", *args], capture_output=True, text=True, timeout=60, check=False)


def install(args: argparse.Namespace) -> int:
    from agent.io.keys import KeyFileError, load_or_create_key, peer_id_of

    tools = gather_tools()
    paths = service_paths(tools.system)
    paths.config_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # holds the key: owner only
    backend = detect_backend(tools) if args.backend == "auto" else args.backend
    plan = build_plan(backend, tools)
    print(
        f"backend: {backend}"
        + (" (detected)" if args.backend == "auto" else "")
        + f"; CMake flags: {plan.cmake_args_text or '(none)'}"
    )
    if tools.system not in ("Linux", "Darwin"):
        raise CannotInstall(f"no service manager support for {tools.system}", "run `baton node --tracker ...` yourself")
    if tools.system == "Linux" and "systemctl" not in tools.on_path and not args.no_start:
        raise CannotInstall(
            "this machine has no systemd (systemctl is not on PATH), so the node cannot run as a service",
            "run it in a terminal or under your init: baton node --tracker ADDR --models-dir DIR --key KEY "
            "(or pass --no-start to write the unit anyway)",
        )
    if args.no_build:
        binary = REPO_ROOT / plan.build_dir / "baton-worker"
        if not os.access(binary, os.X_OK):
            raise CannotInstall(f"--no-build, but there is no {binary}", "drop --no-build")
    else:
        binary = build_worker(plan, paths.config_dir / f"build-{backend}.log")
    print(f"worker: {binary}")
    key_path = Path(args.key) if args.key else paths.key_path
    try:
        key = load_or_create_key(key_path)
    except (KeyFileError, OSError) as error:
        raise CannotInstall(
            f"node key {key_path}: {error}", f"chmod 600 {key_path}, or remove it to make a new one"
        ) from None
    print(f"node key: {key_path} (peer id {peer_id_of(key)})")
    config = {
        "schema_version": 1,
        "tracker": args.tracker,
        "key": str(key_path.resolve()),
        "models_dir": str(Path(args.models_dir or paths.models_dir).resolve()),
        "memory_bytes": args.memory_bytes,
        "backend": backend,
        "worker_binary": str(binary),
        "relay": bool(args.relay),
        "listen": args.listen,
        "unit_path": str(paths.unit_path),
    }
    Path(config["models_dir"]).mkdir(parents=True, exist_ok=True, mode=0o700)
    paths.config_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths.config_path.write_text(json.dumps(config, indent=2) + "\n")
    env = {"BATON_WORKER_BIN": str(binary), "PYTHONUNBUFFERED": "1"}
    paths.unit_path.parent.mkdir(parents=True, exist_ok=True)
    if tools.system == "Darwin":
        log_path = paths.config_dir / "node.log"
        paths.unit_path.write_bytes(launchd_plist(LAUNCHD_LABEL, node_argv(config), env, log_path=str(log_path)))
        print(f"launchd agent: {paths.unit_path} (log: {log_path})")
        if not args.no_start:
            target = f"gui/{os.getuid()}"
            subprocess.run(["launchctl", "bootout", target, str(paths.unit_path)], capture_output=True, check=False)
            done = subprocess.run(
                ["launchctl", "bootstrap", target, str(paths.unit_path)], capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                raise CannotInstall(
                    f"launchctl bootstrap failed: {done.stderr.strip()}",
                    f"launchctl bootstrap {target} {paths.unit_path}",
                )
            print("started; it starts again at every login and after a failure")
        return 0
    unit = systemd_unit(node_argv(config), env, description=f"Baton node (serves layer ranges to {args.tracker})")
    paths.unit_path.write_text(unit)
    print(f"systemd user unit: {paths.unit_path}")
    if args.no_start:
        print(f"not started (--no-start): systemctl --user enable --now {UNIT_NAME}")
        return 0
    for step in (("daemon-reload",), ("enable", "--now", UNIT_NAME)):
        done = _systemctl(*step)
        if done.returncode != 0:
            raise CannotInstall(
                f"systemctl --user {' '.join(step)} failed: {done.stderr.strip() or done.stdout.strip()}",
                "a user systemd needs a login session: log in (not just su/sudo), or run "
                f"`loginctl enable-linger {os.environ.get('USER', '$USER')}`, then `systemctl --user enable --now {UNIT_NAME}`",
            )
    print(f"started; logs: journalctl --user -u {UNIT_NAME} -f")
    print(f"to start it at boot without logging in: loginctl enable-linger {os.environ.get('USER', '$USER')}")
    return 0


def uninstall(args: argparse.Namespace) -> int:
    system = platform.system()
    paths = service_paths(system)
    config = _read_config(paths)
    unit = Path(config.get("unit_path") or paths.unit_path)
    if not unit.exists():
        print(f"no service installed ({unit} does not exist)")
        return 0
    if system == "Darwin":
        subprocess.run(["launchctl", "bootout", f"gui/{os.getuid()}", str(unit)], capture_output=True, check=False)
    elif shutil.which("systemctl"):
        _systemctl("disable", "--now", UNIT_NAME)
    unit.unlink()
    if system != "Darwin" and shutil.which("systemctl"):
        _systemctl("daemon-reload")
    with contextlib.suppress(FileNotFoundError):
        paths.config_path.unlink()
    print(f"removed {unit}; kept the key ({config.get('key', paths.key_path)}) and fetched models "
          f"({config.get('models_dir', paths.models_dir)})")  # fmt: skip
    return 0


# --- status and doctor ------------------------------------------------------------------------------


def _service_state(system: str, unit: Path) -> str:
    if not unit.exists():
        return "not installed"
    if system == "Darwin":
        done = subprocess.run(["launchctl", "list", LAUNCHD_LABEL], capture_output=True, text=True, check=False)
        return "loaded" if done.returncode == 0 else "installed, not loaded"
    if not shutil.which("systemctl"):
        return "installed (no systemctl here)"
    active = _systemctl("is-active", UNIT_NAME).stdout.strip() or "unknown"
    enabled = _systemctl("is-enabled", UNIT_NAME).stdout.strip() or "unknown"
    return f"{active}, {enabled}"


def query_tracker(tracker: str, peer_id: str, timeout_s: float = TRACKER_TIMEOUT_S):
    """(this node's ``NodeEntry`` or None, the tracker's ``ModelEntry``s) from the tracker,
    asked with a throwaway key (blocking: runs its own trio loop).

    Raises:
      RuntimeError: the tracker could not be asked (the reason in one line).
    """
    import trio
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from agent._proto import swarm_pb2
    from agent.core.net.multiaddrs import peer_id_from_multiaddr
    from agent.core.wire.swarm_wire import SCHEMA_VERSION, TRACKER_PROTOCOL, parse_record
    from agent.io.net.p2p import open_p2p_transport

    async def ask():
        tracker_id = peer_id_from_multiaddr(tracker)
        async with open_p2p_transport(Ed25519PrivateKey.generate(), listen_addrs=()) as transport:
            replies = []
            for body in ({"list_nodes": swarm_pb2.ListNodesRequest()}, {"list_models": swarm_pb2.ListModelsRequest()}):
                request = swarm_pb2.TrackerRequest(schema_version=SCHEMA_VERSION, **body)
                data = await transport.request(
                    tracker_id, [tracker], TRACKER_PROTOCOL, request.SerializeToString(), timeout_s=timeout_s
                )
                reply = parse_record(swarm_pb2.TrackerReply, data)
                if reply.error.code:
                    raise RuntimeError(reply.error.message)
                replies.append(reply)
        entry = next((n for n in replies[0].list_nodes.nodes if n.peer_id == peer_id), None)
        return entry, list(replies[1].list_models.models)

    async def bounded():
        with trio.fail_after(timeout_s * 3):
            return await ask()

    try:
        return trio.run(bounded)
    except Exception as error:  # unreachable tracker, bad address, timeouts: all said the same way
        raise RuntimeError(f"{type(error).__name__}: {error}".splitlines()[0]) from None


def _ranges_text(entry, models) -> list[str]:
    from agent._proto import swarm_pb2

    alias = {m.sha256: m.alias for m in models}
    lines = []
    for s in entry.serving:
        a = s.assignment
        text = f"{alias.get(a.model_sha256, a.model_sha256[:12])}[{a.begin}, {a.end}) {swarm_pb2.AssignmentStatus.State.Name(s.state)}"
        if s.fetch_total_bytes and s.fetched_bytes < s.fetch_total_bytes:
            text += f" fetching {s.fetched_bytes}/{s.fetch_total_bytes} bytes ({s.fetch_bytes_per_s / 1e6:.1f} MB/s)"
        if s.error:
            text += f": {s.error}"
        lines.append(text)
    return lines


def status(args: argparse.Namespace) -> int:
    from agent.io.keys import KeyFileError, load_or_create_key, peer_id_of

    system = platform.system()
    paths = service_paths(system)
    config = _read_config(paths)
    out: dict = {"service": _service_state(system, Path(config.get("unit_path") or paths.unit_path))}
    if not config:
        out["installed"] = False
    else:
        out.update(installed=True, tracker=config["tracker"], backend=config.get("backend"))
        try:
            peer_id = peer_id_of(load_or_create_key(config["key"]))
            out["peer_id"] = peer_id
            entry, models = query_tracker(config["tracker"], peer_id)
            out["admitted"] = entry is not None and entry.alive
            out["ranges"] = [] if entry is None else _ranges_text(entry, models)
        except (KeyFileError, OSError, RuntimeError) as error:
            out["tracker_error"] = str(error)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"service: {out['service']}")
    if not out.get("installed"):
        print("not installed: baton node install --tracker ADDR")
        return 0
    print(f"tracker: {out['tracker']}\nbackend: {out['backend']}\npeer id: {out.get('peer_id', '?')}")
    if "tracker_error" in out:
        print(f"admission: unknown (tracker: {out['tracker_error']})")
    else:
        print(f"admission: {'admitted, alive' if out['admitted'] else 'not admitted / not alive'}")
        for line in out["ranges"] or ["(no ranges)"]:
            print(f"  {line}")
    return 0


def doctor_checks(args: argparse.Namespace, *, free_bytes=None) -> list[Check]:
    """Every check of ``baton node doctor`` (``free_bytes``: a seam for tests)."""
    from agent.io.keys import KeyFileError, load_or_create_key, peer_id_of
    from agent.io.worker.process import WorkerBinaryNotFound, find_worker_binary
    from agent.runtime import expected_pin, worker_runtime

    paths = service_paths()
    config = _read_config(paths)
    tracker = args.tracker or config.get("tracker")
    key_path = args.key or config.get("key") or str(paths.key_path)
    models_dir = args.models_dir or config.get("models_dir") or str(paths.models_dir)
    checks = []
    # the worker
    binary, error, pin, devices = None, None, None, []
    try:
        binary = os.environ.get("BATON_WORKER_BIN") or config.get("worker_binary") or str(find_worker_binary())
        if not os.access(binary, os.X_OK):
            binary = None
    except WorkerBinaryNotFound:
        binary = None
    if binary is not None:
        try:
            runtime = worker_runtime(binary, timeout_s=TOOL_TIMEOUT_S)
            pin = (runtime.llama_cpp_commit, runtime.patch_series_sha256)
            devices = [(d.backend, d.name, d.total_bytes) for d in runtime.devices]
        except (OSError, subprocess.SubprocessError, ValueError, KeyError) as err:
            error = str(err).splitlines()[0] if str(err) else type(err).__name__
    checks.append(check_worker(binary, error, pin, expected_pin()))
    backend = config.get("backend") or "cpu"
    if binary is not None and error is None:
        checks.append(check_backend(backend, devices))
    # the key
    try:
        mode = os.stat(key_path).st_mode
    except FileNotFoundError:
        mode = None
    checks.append(check_key(key_path, mode))
    # the tracker, admission, reachability, disk
    entry, models, tracker_error = None, [], None
    if tracker:
        try:
            peer_id = peer_id_of(load_or_create_key(key_path)) if mode is not None and not mode & 0o077 else ""
            entry, models = query_tracker(tracker, peer_id)
        except (KeyFileError, OSError, RuntimeError) as err:
            tracker_error = str(err)
        checks.append(
            check_tracker(tracker, tracker_error, None if tracker_error else (entry is not None and entry.alive))
        )
    else:
        checks.append(
            Check("tracker", False, "no tracker given and no node installed", "baton node install --tracker ADDR")
        )
    addrs = list(entry.listen_addrs) if entry is not None else ([config["listen"]] if config.get("listen") else [])
    checks.append(check_dialable(addrs, bool(config.get("relay")) or any("/p2p-circuit" in a for a in addrs)))
    needed = 0
    if entry is not None:
        sizes = {m.sha256: m for m in models}
        for a in entry.assigned:
            m = sizes.get(a.model_sha256)
            if m is not None and m.n_layer:
                needed += m.size_bytes * (a.end - a.begin) // m.n_layer
    probe_dir = Path(models_dir)
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    free = shutil.disk_usage(probe_dir).free if free_bytes is None else free_bytes
    checks.append(check_disk(models_dir, free, needed))
    return checks


def doctor(args: argparse.Namespace) -> int:
    checks = doctor_checks(args)
    for line in render_checks(checks):
        print(line)
    return 0 if all(c.ok for c in checks) else 1
