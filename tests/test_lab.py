"""The lab itself: ``baton lab`` and ``open_lab`` on real namespaces, TUN devices and the
forwarder. Delay, cut, NAT and loss as a machine's sockets meet them; every namespace and
process removed however the lab's owner ends (SIGTERM, SIGKILL, a crash swept at the next up).

Needs root (CI runs as root); the lab's own addresses only (198.18.0.0/15).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from agent.core.lab.topology import LabError, LinkChange, LinkSpec, MachineSpec, Topology, full_mesh
from agent.io.lab.harness import Lab, running_lab
from agent.io.lab.measure import tcp_rtt_ms, udp_loss_pct
from agent.io.lab.netns import LabSetupError, check_routes_stay_in_lab, list_namespaces
from agent.io.lab.state import LAB_STATE_DIR

pytestmark = [pytest.mark.lab, pytest.mark.timeout(120)]

BATON = [sys.executable, "-m", "agent.cli"]
GONE_TIMEOUT_S = 20.0


def _lab_name(tag: str) -> str:
    return f"t{os.getpid() % 100000}{tag}"


def _namespaces(lab: str) -> list[str]:
    return [ns for ns in list_namespaces() if ns.startswith(f"baton-{lab}-")]


def _lab_processes(lab: str) -> list[psutil.Process]:
    """The forwarder and guardian of lab ``lab`` (found by their command lines)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if (f"/{lab}/control.sock" in cmdline and "baton-lab-forwarder" in cmdline) or (
            "agent.io.lab.guardian" in cmdline and f" {lab} " in f"{cmdline} "
        ):
            found.append(proc)
    return found


def _wait_gone(lab: str) -> None:
    deadline = time.monotonic() + GONE_TIMEOUT_S
    delay_s = 0.02
    while time.monotonic() < deadline:
        if not _namespaces(lab) and not _lab_processes(lab) and not (LAB_STATE_DIR / lab).exists():
            return
        time.sleep(delay_s)  # polling other processes' clean-up: nothing to wait on
        delay_s = min(2 * delay_s, 0.2)
    pytest.fail(f"lab {lab} left: namespaces {_namespaces(lab)}, processes {_lab_processes(lab)}")


@contextlib.contextmanager
def _lab_up(lab: str, *args: str) -> Iterator[tuple[subprocess.Popen, dict]]:
    """``baton lab up --json --name LAB ARGS``; yields the process and its JSON line. Whatever
    happens, the lab is removed at the end (``baton lab down``)."""
    process = subprocess.Popen(
        [*BATON, "lab", "up", "--json", "--name", lab, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = process.stdout.readline()
        if not line:
            pytest.fail(f"baton lab up printed nothing: {process.stderr.read()}")
        yield process, json.loads(line)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        subprocess.run([*BATON, "lab", "down", lab], capture_output=True, timeout=60, check=False)
        for stream in (process.stdout, process.stderr):
            stream.close()


def _baton(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*BATON, *args], capture_output=True, text=True, timeout=timeout_s, check=False)


def test_lab_up_runs_machines_and_sigterm_removes_every_part() -> None:
    lab = _lab_name("a")
    with _lab_up(lab, "--machines", "3", "--delay-ms", "5") as (process, info):
        assert [(m["name"], m["address"]) for m in info["machines"]] == [
            ("m0", "198.18.0.1"), ("m1", "198.18.0.2"), ("m2", "198.18.0.3"),
        ]  # fmt: skip
        assert sorted(_namespaces(lab)) == sorted(m["netns"] for m in info["machines"])
        assert len(_lab_processes(lab)) == 2  # forwarder and guardian
        assert oct((LAB_STATE_DIR / lab).stat().st_mode & 0o777) == "0o700"

        # a command inside a machine sees its address and only the lab's route
        show = "import os; print(os.environ['BATON_LAB_ADDRESS']); print(open('/proc/net/route').read())"
        done = _baton("lab", "exec", "--lab", lab, "m1", "--", sys.executable, "-c", show)
        assert done.returncode == 0, done.stderr
        address, routes = done.stdout.split("\n", 1)
        assert address == "198.18.0.2"
        destinations = {line.split("\t")[1] for line in routes.strip().splitlines()[1:]}
        assert destinations == {"000012C6"}  # 198.18.0.0 (/15) only: no default route

        assert _baton("lab", "link", "--lab", lab, "m0", "m2", "--delay-ms", "7", "--down").returncode == 0
        status = json.loads(_baton("lab", "status", "--lab", lab, "--json").stdout)
        by_pair = {(r["src"], r["dst"]): r for r in status["forwarder"]["links"]}
        assert by_pair[(0, 2)]["delay_us"] == 7000 and not by_pair[(0, 2)]["up"]
        assert by_pair[(2, 0)]["delay_us"] == 7000 and not by_pair[(2, 0)]["up"]
        assert by_pair[(0, 1)]["delay_us"] == 5000 and by_pair[(0, 1)]["up"]

        bad = _baton("lab", "link", "--lab", lab, "m0", "m9", "--down")
        assert bad.returncode == 2 and "no machine named 'm9'" in bad.stderr
        taken = _baton("lab", "up", "--name", lab, "--machines", "2")
        assert taken.returncode == 2 and f"lab {lab} is running" in taken.stderr

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    _wait_gone(lab)


def test_a_killed_lab_is_removed_by_its_guardian() -> None:
    lab = _lab_name("b")
    with _lab_up(lab, "--machines", "2") as (process, _info):
        assert len(_namespaces(lab)) == 2
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        _wait_gone(lab)


def test_a_crashed_lab_is_swept_at_the_next_up() -> None:
    stale, fresh = _lab_name("c"), _lab_name("d")
    with _lab_up(stale, "--machines", "2") as (process, _info):
        for proc in _lab_processes(stale):  # the guardian too: as after a power cut
            proc.kill()
        process.kill()
        process.wait(timeout=10)
        assert len(_namespaces(stale)) == 2  # left behind
        with _lab_up(fresh, "--machines", "2") as (second, _):
            assert _namespaces(stale) == []
            assert not (LAB_STATE_DIR / stale).exists()
            second.send_signal(signal.SIGINT)
            assert second.wait(timeout=30) == 0
    _wait_gone(stale)
    _wait_gone(fresh)


def test_baton_lab_down_stops_a_running_lab() -> None:
    lab = _lab_name("e")
    with _lab_up(lab, "--machines", "2") as (process, _info):
        done = _baton("lab", "down", lab)
        assert done.returncode == 0, done.stderr
        assert process.wait(timeout=30) == 0  # asked to stop, it removed its lab itself
        _wait_gone(lab)
    assert _baton("lab", "status", "--lab", lab).returncode == 2


def test_lab_refuses_bad_settings_with_their_names(tmp_path: Path) -> None:
    done = _baton("lab", "up", "--machines", "3", "--nat", "m7")
    assert done.returncode == 2 and "--nat names m7" in done.stderr
    topology = tmp_path / "lab.toml"
    topology.write_text('[[machine]]\nname = "a"\n[[machine]]\nname = "b"\nnat = "no"\n')
    done = _baton("lab", "up", "--topology", str(topology))
    assert done.returncode == 2 and "machine b: nat: want true or false" in done.stderr


def _connect(lab: Lab, a: str, b: str, port: int, timeout_s: float) -> bool:
    def attempt() -> bool:
        try:
            with socket.create_connection((lab.address(b), port), timeout=timeout_s):
                return True
        except OSError:
            return False

    return lab.run_in(a, attempt)


def _listen(lab: Lab, machine: str) -> socket.socket:
    return lab.run_in(machine, lambda: socket.create_server((lab.address(machine), 0)))


def test_links_delay_cut_and_heal_as_configured() -> None:
    with running_lab(full_mesh(3, LinkSpec(delay_ms=10)), _lab_name("f")) as lab:
        rtts = tcp_rtt_ms(lab, "m0", "m1", count=10)
        assert 20.0 <= statistics.median(rtts) < 20.0 * 1.1 + 0.3 + 5.0  # generous: CI shares cores
        lab.link("m0", "m1", LinkChange(delay_ms=2))
        assert 4.0 <= statistics.median(tcp_rtt_ms(lab, "m0", "m1", count=10)) < 10.0

        listener = _listen(lab, "m1")
        with listener:
            port = listener.getsockname()[1]
            lab.cut("m0", "m1")
            assert not _connect(lab, "m0", "m1", port, timeout_s=0.5)
            assert _connect(lab, "m2", "m1", port, timeout_s=5.0)  # other links unaffected
            lab.heal("m0", "m1")
            assert _connect(lab, "m0", "m1", port, timeout_s=5.0)
        stats = lab.stats()
        assert stats["links"][0]["drop_down"] > 0  # m0 -> m1's SYNs met the cut
        assert all(m["spoofed"] == 0 and m["unknown_dst"] == 0 for m in stats["machines"])


def test_loss_drops_about_the_configured_share() -> None:
    with running_lab(full_mesh(2, LinkSpec(loss_pct=10)), _lab_name("g")) as lab:
        lost = udp_loss_pct(lab, "m0", "m1", count=2000, pace_s=0.0001, settle_s=0.3)
        assert 6.0 < lost < 14.0  # 2000 draws at 10 %: sd 0.67 points
        counted = lab.stats()["links"][0]
        assert counted["drop_loss"] == pytest.approx(counted["packets"] * 0.10, abs=60)


def test_a_machine_behind_nat_is_reached_only_on_flows_it_opened() -> None:
    topology = Topology((MachineSpec("open"), MachineSpec("home", nat=True), MachineSpec("home2", nat=True)))
    with running_lab(topology, _lab_name("h")) as lab:
        listener = _listen(lab, "home")
        with listener:
            assert not _connect(lab, "open", "home", listener.getsockname()[1], timeout_s=1.0)
        assert lab.stats()["machines"][1]["nat_drops"] > 0
        listener = _listen(lab, "open")
        with listener:
            assert _connect(lab, "home", "open", listener.getsockname()[1], timeout_s=5.0)  # it dials out

        # two machines behind the filter meet by simultaneous open from their listening ports
        def punch(machine: str, own_port: int, peer: str, peer_port: int) -> socket.socket:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((lab.address(machine), own_port))
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect((lab.address(peer), peer_port))
            return sock

        a = lab.run_in("home", lambda: punch("home", 47001, "home2", 47002))
        b = lab.run_in("home2", lambda: punch("home2", 47002, "home", 47001))
        with a, b:
            for sock in (a, b):
                sock.settimeout(10)
                sock.setblocking(True)
            a.settimeout(10)
            a.sendall(b"hello")  # blocks until the handshake is done, then sends
            b.settimeout(10)
            assert b.recv(5) == b"hello"


def test_the_lab_refuses_a_route_that_leaves_it() -> None:
    with running_lab(full_mesh(2), _lab_name("i")) as lab:
        netns = lab.machine("m0").netns
        check_routes_stay_in_lab(netns)
        subprocess.run(["ip", "-n", netns, "route", "add", "default", "dev", "wan0"], check=True)
        with pytest.raises(LabSetupError, match="default route"):
            check_routes_stay_in_lab(netns)


def test_running_lab_refuses_a_taken_name() -> None:
    name = _lab_name("j")
    with running_lab(full_mesh(2), name):
        with pytest.raises(LabError, match=f"lab {name} is running"):
            with running_lab(full_mesh(2), name):
                pass
    assert _namespaces(name) == []
