"""The lab's forwarder process (``native/lab/forwarder.cpp``) and its control socket.

Owns: finding the binary, starting it with the machines' TUN fds and a lifeline (the read end
of a pipe only this process writes to: the forwarder exits when this process does, however it
ends), waiting until its control socket answers, and one request/answer exchange on that
socket. What the lines mean is ``agent.core.lab.topology`` (and ``native/lab/link_model.h``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.core.lab.topology import LabError
from agent.runtime import REPO_ROOT

from .netns import LabSetupError

__all__ = ["ForwarderProcess", "control_request", "find_forwarder_binary", "start_forwarder"]

DEFAULT_BINARY = REPO_ROOT / "build" / "native" / "baton-lab-forwarder"
BINARY_ENV = "BATON_LAB_FORWARDER_BIN"
CONTROL_TIMEOUT_S = 10.0
START_TIMEOUT_S = 10.0


def find_forwarder_binary() -> Path:
    """``$BATON_LAB_FORWARDER_BIN``, else ``<repo>/build/native/baton-lab-forwarder``."""
    path = Path(os.environ.get(BINARY_ENV) or DEFAULT_BINARY)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise LabSetupError(f"the lab's forwarder is not built at {path}: run `make native` in {REPO_ROOT}")
    return path


def control_request(control_path: str | os.PathLike, line: str, timeout_s: float = CONTROL_TIMEOUT_S) -> str:
    """Send one control line, return the answer line.

    Raises:
      LabError: the forwarder refused the line (the message is its reason).
      LabSetupError: no forwarder answers at ``control_path``.
    """
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(control_path))
            sock.sendall(line.encode() + b"\n")
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
    except OSError as err:
        raise LabSetupError(f"the lab's forwarder at {control_path} does not answer: {err}") from None
    text = answer.decode(errors="replace").strip()
    if text.startswith("error: "):
        raise LabError(text.removeprefix("error: "))
    if not text:
        raise LabSetupError(f"the lab's forwarder at {control_path} closed without an answer to {line!r}")
    return text


def stats(control_path: str | os.PathLike) -> dict[str, Any]:
    """The forwarder's counters (``native/lab/forwarder.cpp`` stats_json)."""
    return json.loads(control_request(control_path, "stats"))


@dataclass
class ForwarderProcess:
    process: subprocess.Popen
    control_path: Path
    log_path: Path
    lifeline_w: int

    def stop(self, grace_s: float = 5.0) -> None:
        """Close its lifeline (it exits), then kill it if it lingers; reap it."""
        with contextlib.suppress(OSError):
            os.close(self.lifeline_w)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_forwarder(
    control_path: Path, tuns: Sequence[tuple[int, str]], log_path: Path, seed: int = 1
) -> ForwarderProcess:
    """Start the forwarder on ``tuns`` ((fd, address) in machine order) and wait until its
    control socket answers. The caller may close its own copies of the fds afterwards.

    Raises:
      LabSetupError: it exited or did not answer within ``START_TIMEOUT_S``; with its log.
    """
    binary = find_forwarder_binary()
    lifeline_r, lifeline_w = os.pipe()  # both non-inheritable; pass_fds hands over the read end
    argv = [str(binary), "--control", str(control_path), "--seed", str(seed), "--lifeline-fd", str(lifeline_r)]
    argv += [a for fd, address in tuns for a in ("--tun", f"{fd}={address}")]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=[lifeline_r, *(fd for fd, _ in tuns)],
            start_new_session=True,  # a Ctrl-C to the lab's terminal reaches the owner, who stops it in order
        )  # fmt: skip
    os.close(lifeline_r)
    forwarder = ForwarderProcess(process, control_path, log_path, lifeline_w)
    deadline = time.monotonic() + START_TIMEOUT_S
    delay_s = 0.005
    while True:
        if process.poll() is not None:
            break
        try:
            if control_request(control_path, "ping", timeout_s=1.0) == "pong":
                return forwarder
        except (LabSetupError, LabError):
            pass
        if time.monotonic() > deadline:
            break
        time.sleep(delay_s)  # polling a socket that appears once the process is up
        delay_s = min(delay_s * 2, 0.1)
    forwarder.stop(grace_s=1.0)
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
    raise LabSetupError(f"the lab's forwarder did not start (exit {process.poll()}):\n{tail}")
