"""agent.io.process_memory: the heap thresholds every Baton process sets at start."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.worker, pytest.mark.timeout(60)]

REPO_ROOT = Path(__file__).resolve().parent.parent

# Six 1 MiB buffers made, touched and freed, ten times over (what a node does with a prefill's
# boundaries): the page faults this costs. Each run in a process of its own, because the
# thresholds are process-wide.
_CHURN = """
import resource, sys
if sys.argv[1] == "tuned":
    from agent.io.process_memory import keep_freed_memory
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # idempotent
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def churn():
    blocks = []
    for _ in range(6):
        block = bytearray(1 << 20)
        block[::4096] = bytes(256)  # touch every page
        blocks.append(block)
    del blocks
churn(); churn()
before = faults()
for _ in range(10):
    churn()
print(faults() - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _CHURN, mode], cwd=REPO_ROOT, check=True, timeout=30, capture_output=True, text=True
    )
    return int(done.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_buffers_are_reused_not_faulted_in_again() -> None:
    plain, tuned = _faults("plain"), _faults("tuned")
    assert plain > 10 * 256  # glibc's defaults: the freed megabytes go back to the kernel
    assert tuned < plain // 20, (plain, tuned)
