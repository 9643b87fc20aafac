"""Decisions behind ``baton node install`` and ``baton node doctor``.

Owns, as pure functions over facts the shell gathers (agent/io/node/service.py):
- GPU backend detection from what the tools on this machine print (``nvidia-smi -L``,
  ``rocminfo``, ``vulkaninfo --summary``, the OS), and the build plan of a backend: the
  llama.cpp CMake flags, the build directory, or ``CannotInstall`` with the fix (no CUDA
  toolkit for an NVIDIA GPU, no ROCm ``hipcc`` for an AMD one, no ``glslc`` for Vulkan, Metal
  off macOS);
- the per-user service definitions: a systemd user unit (Linux) and a launchd agent plist
  (macOS), both restarting the node when it fails but not when it was refused or mis-set-up
  (exit codes 2 and 3 of ``baton node``: restarting would only repeat the refusal);
- the doctor's verdicts: one ``Check`` per requirement, with what to do for each failure.

Pure: no I/O, subprocess, clock or environment access; must not import trio or agent.io.
"""

from __future__ import annotations

import dataclasses
import plistlib
import re
import shlex
from collections.abc import Mapping, Sequence

__all__ = [
    "BACKENDS",
    "BuildPlan",
    "CannotInstall",
    "Check",
    "HostTools",
    "build_plan",
    "check_backend",
    "check_dialable",
    "check_disk",
    "check_key",
    "check_tracker",
    "check_worker",
    "detect_backend",
    "launchd_plist",
    "parse_nvidia_smi",
    "parse_rocminfo",
    "parse_vulkaninfo",
    "render_checks",
    "systemd_unit",
]

BACKENDS = ("cpu", "cuda", "hip", "vulkan", "metal")
#: ``baton node`` exit codes after which a restart cannot help (agent/io/node/cli.py)
NO_RESTART_EXIT_CODES = (2, 3)
#: how the worker binary names each backend in ``--version`` (ggml backend names)
BACKEND_DEVICE_NAMES = {"cpu": "CPU", "cuda": "CUDA", "hip": "HIP", "vulkan": "Vulkan", "metal": "Metal"}


class CannotInstall(Exception):
    """Something ``baton node install`` cannot do here; ``fix`` says what the user can do."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}\n  fix: {fix}")
        self.problem = problem
        self.fix = fix


@dataclasses.dataclass(frozen=True)
class HostTools:
    """What the shell found on this machine.

    ``system``: ``platform.system()`` ("Linux", "Darwin", ...); ``machine``: its CPU
    architecture; ``on_path``: the names of the tools found on PATH (nvidia-smi, nvcc, rocminfo,
    hipcc, vulkaninfo, glslc, systemctl, launchctl, cmake, xcrun); the three outputs: those
    commands' stdout ("" when the tool is missing or failed).
    """

    system: str
    machine: str = ""
    on_path: frozenset[str] = frozenset()
    nvidia_smi_output: str = ""
    rocminfo_output: str = ""
    vulkaninfo_output: str = ""


def parse_nvidia_smi(text: str) -> list[str]:
    """GPU names from ``nvidia-smi -L`` (``GPU 0: NVIDIA GeForce RTX 4090 (UUID: ...)``)."""
    return [m.group(1).strip() for m in re.finditer(r"^GPU \d+: (.+?)(?: \(UUID: [^)]*\))?$", text, re.M)]


def parse_rocminfo(text: str) -> list[str]:
    """The gfx targets of the GPU agents in ``rocminfo`` output (``Name: gfx1100``)."""
    targets = []
    for m in re.finditer(r"^\s*Name:\s+(gfx[0-9a-f]+)\s*$", text, re.M):
        if m.group(1) not in targets:
            targets.append(m.group(1))
    return targets


def parse_vulkaninfo(text: str) -> list[str]:
    """Names of the non-CPU devices in ``vulkaninfo --summary`` (software rasterisers such as
    llvmpipe report ``PHYSICAL_DEVICE_TYPE_CPU`` and do not count)."""
    names = []
    for block in re.split(r"^GPU\d+:\s*$", text, flags=re.M)[1:]:
        kind = re.search(r"deviceType\s*=\s*(\S+)", block)
        name = re.search(r"deviceName\s*=\s*(.+)", block)
        if name and (kind is None or "CPU" not in kind.group(1)):
            names.append(name.group(1).strip())
    return names


def detect_backend(tools: HostTools) -> str:
    """The backend this machine's GPU needs: Metal on macOS (Apple silicon), CUDA when
    ``nvidia-smi`` lists a GPU, HIP when ``rocminfo`` lists a gfx agent, Vulkan when
    ``vulkaninfo`` shows a real GPU, else CPU."""
    if tools.system == "Darwin" and tools.machine in ("arm64", "aarch64"):
        return "metal"
    if parse_nvidia_smi(tools.nvidia_smi_output):
        return "cuda"
    if parse_rocminfo(tools.rocminfo_output):
        return "hip"
    if parse_vulkaninfo(tools.vulkaninfo_output):
        return "vulkan"
    return "cpu"


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """How to build the worker for ``backend``: extra CMake flags and the build directory
    (relative to the checkout; the CPU build is the one ``make`` makes, so it is reused)."""

    backend: str
    cmake_args: tuple[str, ...]
    build_dir: str

    @property
    def cmake_args_text(self) -> str:
        return " ".join(self.cmake_args)


def build_plan(backend: str, tools: HostTools) -> BuildPlan:
    """The build of ``backend`` on this machine.

    Raises:
      CannotInstall: the backend's toolkit is missing here (with the fix), or unknown backend.
    """
    have = tools.on_path
    if backend == "cpu":
        return BuildPlan("cpu", (), "build/native")
    if backend == "cuda":
        if "nvcc" not in have:
            raise CannotInstall(
                "an NVIDIA GPU needs the CUDA toolkit (nvcc) to build the worker, and nvcc is not on PATH",
                "install the CUDA toolkit (Debian/Ubuntu: sudo apt-get install nvidia-cuda-toolkit, or NVIDIA's "
                "packages from https://developer.nvidia.com/cuda-downloads) and put its bin/ on PATH; "
                "or run with --backend cpu",
            )
        return BuildPlan("cuda", ("-DGGML_CUDA=ON",), "build/native-cuda")
    if backend == "hip":
        if "hipcc" not in have:
            raise CannotInstall(
                "an AMD GPU needs ROCm (hipcc) to build the worker, and hipcc is not on PATH",
                "install ROCm (https://rocm.docs.amd.com, Debian/Ubuntu: the rocm-hip-sdk package) and put "
                "/opt/rocm/bin on PATH; or run with --backend vulkan or --backend cpu",
            )
        targets = parse_rocminfo(tools.rocminfo_output)
        args = ["-DGGML_HIP=ON"] + ([f"-DAMDGPU_TARGETS={';'.join(targets)}"] if targets else [])
        return BuildPlan("hip", tuple(args), "build/native-hip")
    if backend == "vulkan":
        if "glslc" not in have:
            raise CannotInstall(
                "the Vulkan backend compiles its shaders with glslc, and glslc is not on PATH",
                "install it with the Vulkan headers (Debian/Ubuntu: sudo apt-get install glslc libvulkan-dev); "
                "or run with --backend cpu",
            )
        return BuildPlan("vulkan", ("-DGGML_VULKAN=ON",), "build/native-vulkan")
    if backend == "metal":
        if tools.system != "Darwin":
            raise CannotInstall(f"Metal exists only on macOS, this is {tools.system}", "choose --backend auto")
        return BuildPlan("metal", ("-DGGML_METAL=ON",), "build/native-metal")
    raise CannotInstall(f"unknown backend {backend!r}", f"choose one of: auto, {', '.join(BACKENDS)}")


# --- services ------------------------------------------------------------------------------------


def _systemd_quote(arg: str) -> str:
    # systemd splits ExecStart like a shell, with its own specifiers: '%' must be doubled
    return shlex.quote(arg).replace("%", "%%")


def systemd_unit(argv: Sequence[str], env: Mapping[str, str], *, description: str, restart_delay_s: int = 5) -> str:
    """A systemd *user* unit that runs ``argv`` at login (or at boot with lingering), restarts it
    when it fails, and not after a refusal or a set-up error (restarting would repeat them)."""
    lines = [
        "[Unit]",
        f"Description={description}",
        "Wants=network-online.target",
        "After=network-online.target",
        "StartLimitIntervalSec=300",
        "StartLimitBurst=10",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={' '.join(_systemd_quote(a) for a in argv)}",
        *(f'Environment="{k}={v}"' for k, v in sorted(env.items())),
        "Restart=on-failure",
        f"RestartSec={restart_delay_s}",
        f"RestartPreventExitStatus={' '.join(str(c) for c in NO_RESTART_EXIT_CODES)}",
        "KillMode=control-group",
        "TimeoutStopSec=30",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ]
    return "\n".join(lines)


def launchd_plist(label: str, argv: Sequence[str], env: Mapping[str, str], *, log_path: str) -> bytes:
    """A launchd agent (``~/Library/LaunchAgents``) that starts ``argv`` at login and restarts it
    when it exits unsuccessfully."""
    return plistlib.dumps(
        {
            "Label": label,
            "ProgramArguments": list(argv),
            "EnvironmentVariables": dict(env),
            "RunAtLoad": True,
            "KeepAlive": {"SuccessfulExit": False},
            "ThrottleInterval": 10,
            "StandardOutPath": log_path,
            "StandardErrorPath": log_path,
        }
    )


# --- doctor ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Check:
    """One requirement: ``ok``, what was found (``detail``) and, when not ok, what to do."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


def check_worker(
    binary: str | None, runtime_error: str | None, runtime_pin: tuple[str, str] | None, expected: tuple[str, str]
) -> Check:
    """The worker binary runs (``--version``) and reports the pinned llama.cpp and patches."""
    name = "worker binary"
    if binary is None:
        return Check(name, False, "no baton-worker binary found", "build it: baton node install (or make native)")
    if runtime_error is not None or runtime_pin is None:
        return Check(
            name, False, f"{binary} does not run: {runtime_error}", "rebuild it: baton node install (or make native)"
        )
    if runtime_pin != expected:
        return Check(
            name, False,
            f"{binary} runs llama.cpp {runtime_pin[0][:12]} with patches {runtime_pin[1][:12]}, "
            f"this checkout pins {expected[0][:12]} / {expected[1][:12]}",
            "rebuild it from this checkout: make llama native (or baton node install)",
        )  # fmt: skip
    return Check(name, True, f"{binary}: pinned llama.cpp {expected[0][:12]}, patches {expected[1][:12]}")


def check_backend(backend: str, devices: Sequence[tuple[str, str, int]]) -> Check:
    """The built backend sees a device of its kind with memory: ``devices`` are the worker's
    (backend name, device name, total bytes)."""
    want = BACKEND_DEVICE_NAMES.get(backend, backend)
    seen = [(b, n, t) for b, n, t in devices if b.lower() == want.lower()]
    name = f"{want} backend"
    if not seen:
        kinds = ", ".join(sorted({b for b, _, _ in devices})) or "none"
        return Check(
            name, False, f"the worker sees no {want} device (it sees: {kinds})",
            f"check the driver (e.g. nvidia-smi / rocminfo / vulkaninfo), then rebuild: baton node install --backend {backend}",
        )  # fmt: skip
    if backend != "cpu" and not any(t > 0 for _, _, t in seen):
        return Check(name, False, f"{seen[0][1]} reports no memory", "check the GPU driver; reboot after installing it")
    text = ", ".join(f"{n} ({t / 2**30:.1f} GiB)" for _, n, t in seen)
    return Check(name, True, text)


def check_key(path: str, mode: int | None) -> Check:
    """The node key exists and only its owner may read it (``mode``: st_mode, None: missing)."""
    name = "node key"
    if mode is None:
        return Check(name, False, f"{path} does not exist", "create it: baton node install (or start baton node once)")
    if mode & 0o077:
        return Check(
            name, False, f"{path} has mode {mode & 0o777:o}: others can read the node's identity",
            f"chmod 600 {shlex.quote(path)}",
        )  # fmt: skip
    return Check(name, True, f"{path} (mode {mode & 0o777:o}, owner only)")


def check_tracker(tracker: str, error: str | None, admitted: bool | None) -> Check:
    """The tracker answers; ``admitted``: the tracker lists this node as alive (None: unknown)."""
    name = "tracker"
    if error is not None:
        return Check(
            name, False, f"{tracker} unreachable: {error}",
            "check the address (it ends /p2p/<tracker id>) and the network; ask the tracker's operator if it runs",
        )  # fmt: skip
    if not admitted:
        return Check(
            name, False, f"{tracker} answers, but does not list this node as admitted and alive",
            "start the node (systemctl --user start baton-node) and read its log "
            "(journalctl --user -u baton-node): a refusal says why",
        )  # fmt: skip
    return Check(name, True, f"{tracker} answers and has admitted this node")


def _is_public_ip4(addr: str) -> bool:
    m = re.match(r"/ip4/(\d+)\.(\d+)\.(\d+)\.(\d+)/", addr + "/")
    if not m:
        return False
    a, b = int(m.group(1)), int(m.group(2))
    private = a in (0, 10, 127) or (a == 172 and 16 <= b < 32) or (a == 192 and b == 168) or (a == 169 and b == 254)
    private = private or (a == 100 and 64 <= b < 128)  # carrier-grade NAT
    return not private


def check_dialable(listen_addrs: Sequence[str], relay: bool) -> Check:
    """Whether others can dial the node: a public address, or the tracker's relay."""
    name = "reachability"
    if relay:
        return Check(name, True, "reached through the tracker's circuit relay (--relay)")
    public = [a for a in listen_addrs if _is_public_ip4(a) and "/p2p-circuit" not in a]
    if public:
        return Check(name, True, f"dialable at {public[0]}")
    shown = ", ".join(listen_addrs) or "no address"
    return Check(
        name, False, f"only private or loopback addresses ({shown}): peers outside cannot dial this node",
        "reinstall with --relay (reached through the tracker), or listen on a public address / forward a port "
        "and pass --listen /ip4/0.0.0.0/tcp/PORT",
    )  # fmt: skip


def check_disk(path: str, free_bytes: int, needed_bytes: int) -> Check:
    """Free space where models are fetched to, against what the assigned ranges need."""
    name = "disk space"
    if free_bytes < needed_bytes:
        return Check(
            name, False,
            f"{free_bytes / 2**30:.2f} GiB free in {path}, the assigned ranges need {needed_bytes / 2**30:.2f} GiB",
            f"free {max(1, (needed_bytes - free_bytes) // 2**20)} MiB there, or reinstall with a smaller --memory-bytes "
            "or another --models-dir",
        )  # fmt: skip
    return Check(name, True, f"{free_bytes / 2**30:.2f} GiB free in {path}, {needed_bytes / 2**30:.2f} GiB needed")


def render_checks(checks: Sequence[Check]) -> list[str]:
    """One line per check (``✓``/``✗``), and under each failure its fix."""
    lines = []
    for check in checks:
        lines.append(f"{'✓' if check.ok else '✗'} {check.name}: {check.detail}")
        if not check.ok and check.fix:
            lines.append(f"    fix: {check.fix}")
    return lines
