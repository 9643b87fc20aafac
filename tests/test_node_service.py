"""``baton node install / uninstall / status / doctor``: backend detection against fake GPU
tools on PATH, the CMake flags per backend, the CPU install on this machine (reusing the
build) with a unit that ``systemd-analyze verify`` accepts, uninstall, and every doctor check
with the fix of each failure."""

from __future__ import annotations

import os
import plistlib
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agent.core.node.install import (
    CannotInstall,
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
    parse_nvidia_smi,
    parse_rocminfo,
    parse_vulkaninfo,
    render_checks,
    systemd_unit,
)

pytestmark = [pytest.mark.worker, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent
NVIDIA_SMI = "GPU 0: NVIDIA GeForce RTX 4090 (UUID: GPU-0f2d6a1e-1111-2222-3333-444455556666)\n"
ROCMINFO = """*******
Agent 1
*******
  Name:                    AMD Ryzen 9 7950X 16-Core Processor
  Device Type:             CPU
*******
Agent 2
*******
  Name:                    gfx1100
  Marketing Name:          Radeon RX 7900 XTX
  Device Type:             GPU
"""
VULKANINFO = """Devices:
========
GPU0:
	apiVersion         = 1.3.255
	deviceType         = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU
	deviceName         = Intel(R) Arc(tm) A770 Graphics (DG2)
GPU1:
	deviceType         = PHYSICAL_DEVICE_TYPE_CPU
	deviceName         = llvmpipe (LLVM 15.0.6, 256 bits)
"""
LLVMPIPE_ONLY = "Devices:\n========\nGPU0:\n\tdeviceType = PHYSICAL_DEVICE_TYPE_CPU\n\tdeviceName = llvmpipe\n"


# --- pure core -------------------------------------------------------------------------------------


def test_tool_outputs_are_parsed() -> None:
    assert parse_nvidia_smi(NVIDIA_SMI) == ["NVIDIA GeForce RTX 4090"]
    assert parse_nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate with the driver") == []
    assert parse_rocminfo(ROCMINFO) == ["gfx1100"]
    assert parse_vulkaninfo(VULKANINFO) == ["Intel(R) Arc(tm) A770 Graphics (DG2)"]
    assert parse_vulkaninfo(LLVMPIPE_ONLY) == []


@pytest.mark.parametrize(
    ("tools", "backend", "flags"),
    [
        (HostTools("Linux", on_path=frozenset({"nvidia-smi", "nvcc"}), nvidia_smi_output=NVIDIA_SMI), "cuda", ("-DGGML_CUDA=ON",)),
        (HostTools("Linux", on_path=frozenset({"rocminfo", "hipcc"}), rocminfo_output=ROCMINFO), "hip",
         ("-DGGML_HIP=ON", "-DAMDGPU_TARGETS=gfx1100")),
        (HostTools("Linux", on_path=frozenset({"vulkaninfo", "glslc"}), vulkaninfo_output=VULKANINFO), "vulkan",
         ("-DGGML_VULKAN=ON",)),
        (HostTools("Linux", on_path=frozenset({"vulkaninfo", "glslc"}), vulkaninfo_output=LLVMPIPE_ONLY), "cpu", ()),
        (HostTools("Darwin", machine="arm64"), "metal", ("-DGGML_METAL=ON",)),
        (HostTools("Linux"), "cpu", ()),
    ],
)  # fmt: skip
def test_detection_chooses_the_backend_and_its_cmake_flags(tools: HostTools, backend: str, flags: tuple) -> None:
    assert detect_backend(tools) == backend
    plan = build_plan(backend, tools)
    assert plan.cmake_args == flags
    assert plan.build_dir == ("build/native" if backend == "cpu" else f"build/native-{backend}")


@pytest.mark.parametrize(
    ("backend", "tools", "fix"),
    [
        ("cuda", HostTools("Linux", nvidia_smi_output=NVIDIA_SMI), "install the CUDA toolkit"),
        ("hip", HostTools("Linux", rocminfo_output=ROCMINFO), "install ROCm"),
        ("vulkan", HostTools("Linux", vulkaninfo_output=VULKANINFO), "apt-get install glslc"),
        ("metal", HostTools("Linux"), "auto"),
    ],
)
def test_a_missing_toolkit_says_so_with_the_fix(backend: str, tools: HostTools, fix: str) -> None:
    with pytest.raises(CannotInstall) as caught:
        build_plan(backend, tools)
    assert fix in caught.value.fix


def test_the_services_restart_on_failure_but_not_after_a_refusal() -> None:
    unit = systemd_unit(["/usr/bin/python3", "-m", "agent.cli", "node", "--tracker", "/ip4/1.2.3.4/tcp/1/p2p/Qm%x"],
                        {"BATON_WORKER_BIN": "/w"}, description="Baton node")  # fmt: skip
    assert "Restart=on-failure" in unit and "RestartPreventExitStatus=2 3" in unit
    assert "WantedBy=default.target" in unit and 'Environment="BATON_WORKER_BIN=/w"' in unit
    assert "Qm%%x" in unit  # systemd specifiers escaped
    plist = plistlib.loads(launchd_plist("org.baton.node", ["/py", "-m", "agent.cli"], {"A": "b"}, log_path="/l"))
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ProgramArguments"] == ["/py", "-m", "agent.cli"] and plist["EnvironmentVariables"] == {"A": "b"}


def test_doctor_verdicts_give_a_fix_for_every_failure() -> None:
    pin = ("c" * 40, "p" * 64)
    failures = [
        check_worker(None, None, None, pin),
        check_worker("/w", "exit 127", None, pin),
        check_worker("/w", None, ("d" * 40, "p" * 64), pin),
        check_backend("cuda", [("CPU", "cpu", 1 << 34)]),
        check_key("/k", None),
        check_key("/k", stat.S_IFREG | 0o644),
        check_tracker("/ip4/127.0.0.1/tcp/9/p2p/x", "connection refused", None),
        check_tracker("/ip4/127.0.0.1/tcp/9/p2p/x", None, False),
        check_dialable(["/ip4/192.168.1.5/tcp/4001", "/ip4/127.0.0.1/tcp/4001"], relay=False),
        check_disk("/models", 10 << 20, 1 << 30),
    ]
    assert all(not c.ok and c.fix for c in failures)
    assert "chmod 600 /k" in failures[5].fix and "--relay" in failures[8].fix
    passes = [
        check_worker("/w", None, pin, pin),
        check_backend("cpu", [("CPU", "Xeon", 1 << 34)]),
        check_key("/k", stat.S_IFREG | 0o600),
        check_tracker("t", None, True),
        check_dialable(["/ip4/203.0.113.7/tcp/4001"], relay=False),
        check_dialable([], relay=True),
        check_disk("/models", 2 << 30, 1 << 30),
    ]
    assert all(c.ok for c in passes)
    lines = render_checks(failures[:1] + passes[:1])
    assert (
        lines[0].startswith("✗ worker binary") and lines[1].startswith("    fix: ") and lines[2].startswith("✓ worker")
    )


# --- the shell on this machine ----------------------------------------------------------------------


def fake_tool(bin_dir: Path, name: str, output: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}EOF\n")
    path.chmod(0o755)


def test_detection_reads_fake_gpu_tools_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.io.node.service import gather_tools

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    for name, output, backend in (
        ("vulkaninfo", VULKANINFO, "vulkan"),
        ("rocminfo", ROCMINFO, "hip"),
        ("nvidia-smi", NVIDIA_SMI, "cuda"),  # NVIDIA wins over the others
    ):
        fake_tool(bin_dir, name, output)
        tools = gather_tools()
        assert detect_backend(tools) == backend, name
    with pytest.raises(CannotInstall, match="CUDA toolkit"):
        build_plan("cuda", tools)
    fake_tool(bin_dir, "nvcc", "")
    assert build_plan("cuda", gather_tools()).cmake_args == ("-DGGML_CUDA=ON",)


def baton(*args: str, env: dict[str, str], timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, env=env, timeout=timeout_s, cwd=REPO
    )


@pytest.fixture
def home_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "BATON_WORKER_BIN"))}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "data"))
    return env


TRACKER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWEyoppNCUx8Yx66oV9fJnriXwCcXwDDUA2kj6vnc6iDEp"


@pytest.mark.slow
def test_install_cpu_builds_or_reuses_the_worker_writes_a_valid_unit_and_uninstalls(
    home_env: dict[str, str], tmp_path: Path
) -> None:
    done = baton("node", "install", "--tracker", TRACKER, "--backend", "cpu", "--memory-bytes", "1000000000",
                 "--no-start", env=home_env)  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    assert "backend: cpu" in done.stdout and str(REPO / "build/native/baton-worker") in done.stdout
    unit = tmp_path / "config/systemd/user/baton-node.service"
    text = unit.read_text()
    assert f"--tracker {TRACKER}" in text and "--memory-bytes 1000000000" in text and "--models-dir" in text
    assert "Restart=on-failure" in text and f'Environment="BATON_WORKER_BIN={REPO}/build/native/baton-worker"' in text
    key = tmp_path / "config/baton/node.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(key.parent.stat().st_mode) & 0o077 == 0
    if shutil.which("systemd-analyze"):
        # system mode: the user manager needs a login session, which a test run does not have
        verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
        assert verify.returncode == 0, verify.stderr
    status = baton("node", "status", env=home_env)
    assert status.returncode == 0 and "service: " in status.stdout and "admission: unknown" in status.stdout
    gone = baton("node", "uninstall", env=home_env)
    assert gone.returncode == 0 and not unit.exists() and key.exists()
    assert "not installed" in baton("node", "status", env=home_env).stdout


def test_install_without_systemd_says_so_with_the_fix(home_env: dict[str, str], tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("make", "cmake"):  # everything but systemctl
        if shutil.which(tool):
            os.symlink(shutil.which(tool), bin_dir / tool)
    env = {**home_env, "PATH": str(bin_dir)}
    done = baton("node", "install", "--tracker", TRACKER, "--backend", "cpu", "--no-build", env=env)
    assert done.returncode == 2
    assert "no systemd" in done.stderr and "fix: run it in a terminal" in done.stderr


def test_doctor_prints_every_check_and_the_fix_of_each_failure(home_env: dict[str, str], tmp_path: Path) -> None:
    key = tmp_path / "node.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o644)  # bad key mode
    env = {**home_env, "BATON_WORKER_BIN": str(tmp_path / "no-such-worker")}  # missing worker
    done = baton("node", "doctor", "--tracker", TRACKER, "--key", str(key), env=env, timeout_s=120)  # tracker down
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    names = [line[2:].split(":")[0] for line in lines if line[:1] in "✓✗"]
    assert names == ["worker binary", "node key", "tracker", "reachability", "disk space"], done.stdout
    text = done.stdout
    assert "✗ worker binary: no baton-worker binary found" in text and "fix: build it: baton node install" in text
    assert "✗ node key" in text and f"fix: chmod 600 {key}" in text
    assert "✗ tracker" in text and "unreachable" in text and "fix: check the address" in text
    assert "✓ disk space" in text


def test_doctor_on_this_machine_and_with_no_space(
    home_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from agent.io.keys import load_or_create_key
    from agent.io.node import service

    key = tmp_path / "k" / "node.key"
    load_or_create_key(key)
    monkeypatch.delenv("BATON_WORKER_BIN", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    args = argparse.Namespace(tracker=None, key=str(key), models_dir=str(tmp_path / "models"))
    checks = {c.name: c for c in service.doctor_checks(args)}
    assert checks["worker binary"].ok, checks["worker binary"]
    assert checks["CPU backend"].ok and checks["node key"].ok and checks["disk space"].ok
    assert not checks["tracker"].ok and "baton node install --tracker" in checks["tracker"].fix
    # no space: the check compares what the disk has with what the ranges need
    low = {c.name: c for c in service.doctor_checks(args, free_bytes=-1)}
    assert not low["disk space"].ok and "free" in low["disk space"].fix


@pytest.mark.gpu
@pytest.mark.timeout(3600)
def test_install_auto_builds_the_gpu_worker_and_doctor_sees_the_gpu(home_env: dict[str, str]) -> None:
    """On a GPU machine (BATON_GPU=1): the detected backend is a GPU one, the build with its
    CMake flags succeeds, and the doctor's backend check sees the device with memory."""
    done = baton("node", "install", "--tracker", TRACKER, "--no-start", env=home_env, timeout_s=3500)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "backend: cpu" not in done.stdout
    doctor = baton("node", "doctor", env=home_env, timeout_s=120)
    backend_lines = [line for line in doctor.stdout.splitlines() if "backend:" in line]
    assert backend_lines and backend_lines[0].startswith("✓"), doctor.stdout
