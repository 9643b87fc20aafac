"""How a Baton process's C heap keeps the memory it frees (glibc's ``mallopt``).

Owns: one call, made once at process start by every role's entry point (``agent.cli``) and by
the benchmarks' own processes, which stand in for them.

Why: every boundary that crosses a hop is a few buffers of up to megabytes (the socket
receive buffer, TLS records, the frame, the payload, the worker's reply). glibc gives a freed
block over its mmap threshold back to the kernel at once, and trims the top of the heap once
more than its trim threshold is free, so the next buffer of that size is page-faulted in
again, a page at a time. Measured on this project's 2-core VM with ``bench/tools/transport_rtt.py``:
a 1 MiB round trip on the channel spent ~0.5 ms of each side's CPU per MiB on those faults,
and an 8 KiB one paid for a fresh 256 KiB receive buffer each time. With the thresholds
raised, freed buffers are reused from the heap.

The cost: up to ``TRIM_THRESHOLD_BYTES`` of freed memory may stay with the process (it is
reused, not leaked), and blocks under ``MMAP_THRESHOLD_BYTES`` come from the heap. A no-op
(False) where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "keep_freed_memory"]

log = logging.getLogger(__name__)

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Blocks up to this size come from the heap (glibc's largest dynamic threshold, 32 MiB on
#: 64-bit: a channel frame of the default 64 MiB limit is still mapped on its own).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free memory at the top of the heap kept for reuse before it is given back.
TRIM_THRESHOLD_BYTES = 128 << 20

_applied = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True when both took effect
    (or already had). Idempotent."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    if not ok:
        log.info("mallopt refused the heap thresholds; big buffers are page-faulted in each time")
    _applied = ok
    return ok
