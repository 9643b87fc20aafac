"""The lab's guardian: a small process that sweeps a lab once the process that owns it is gone.

``python -m agent.io.lab.guardian LAB OWNER_PID``, its stdin the read end of a pipe that only
the owner writes to. It waits for end of file there: the owner has ended, whichever way (a
clean exit, SIGTERM, SIGKILL, a crash). If the lab is still written down in the owner's name,
it sweeps it (``agent.io.lab.state.sweep_lab``: what runs in its machines killed, namespaces
and record removed), then exits. It leads its own session, so signals meant for the owner's
terminal or process group do not reach it first.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

__all__ = ["main", "start_guardian"]


def start_guardian(lab: str) -> tuple[subprocess.Popen, int]:
    """Start the guardian of lab ``lab`` for this process; returns it and the write end of its
    pipe (keep it open while the lab lives; closing it, or ending, makes the guardian sweep)."""
    read_end, write_end = os.pipe()  # non-inheritable: no other child holds the write end
    guardian = subprocess.Popen(
        [sys.executable, "-m", "agent.io.lab.guardian", lab, str(os.getpid())],
        stdin=read_end, stdout=subprocess.DEVNULL, stderr=None, start_new_session=True,
        close_fds=True,
    )  # fmt: skip
    os.close(read_end)
    return guardian, write_end


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s baton lab guardian: %(message)s", stream=sys.stderr)
    lab, owner_pid = argv[0], int(argv[1])
    from .state import read_record, sweep_lab

    while sys.stdin.buffer.read(65536):
        pass  # nobody writes: this returns at end of file, when the owner is gone
    record = read_record(lab)
    if record is not None and record.owner_pid != owner_pid:
        return 0  # a new lab of that name, made by another owner: not ours
    swept = sweep_lab(lab)
    if swept:
        logging.info("lab %s: its owner (pid %d) ended; removed %s", lab, owner_pid, ", ".join(swept))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
