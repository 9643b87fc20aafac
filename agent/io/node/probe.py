"""Host probe: what a node puts into its fingerprint about the machine it runs on.

Owns measuring: OS, CPU model and cores, RAM (psutil), the worker binary's llama.cpp pin,
patch series and devices (``agent.runtime.worker_runtime``), and two throughput *proxies*:

- ``decode_s_per_block``: the time of one float32 matrix-vector product shaped like one
  llama-style block's decode for a single token at width ``reference_n_embd``
  (``[1, n_embd] x [n_embd, 12 * n_embd]``: q, k, v, o are 4 n_embd^2 weights, a gated FFN of
  width 8/3 n_embd another 8 n_embd^2). Decoding one token is bound by reading the weights, so
  this ranks machines the way real blocks do; it is not the time of any particular model
  (real weights are quantized and attention adds work per cached position). Best of
  ``decode_repeats`` runs.
- ``bandwidth_bytes_per_s``: the rate of copying ``bandwidth_bytes`` through a loopback
  socket pair (kernel copy both ways). It bounds what this host can push, not what its
  network link carries; the tracker learns link latency from use.

Blocking (numpy, subprocess, sockets): trio code calls ``probe_host`` through
``trio.to_thread.run_sync``. Makes no decisions.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import socket
import threading
import time

import numpy as np
import psutil

from agent.core.wire.fingerprint import DeviceInfo, HostProbe
from agent.runtime import worker_runtime

__all__ = [
    "RANGED_ARCHITECTURES",
    "ProbeConfig",
    "cpu_model",
    "measure_decode_s_per_block",
    "measure_loopback_bandwidth",
    "probe_host",
]

#: Architectures with a ranged graph in the patch series (patches/0005-*: llama, qwen2, qwen3,
#: gemma3). ``baton-worker --version`` does not list them, so the node states them here.
RANGED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """How long the throughput proxies run (defaults: well under a second in total)."""

    reference_n_embd: int = 1024
    decode_repeats: int = 5
    bandwidth_bytes: int = 16 * 1024 * 1024
    bandwidth_chunk_bytes: int = 1024 * 1024
    runtime_timeout_s: float = 30.0


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def measure_decode_s_per_block(n_embd: int = 1024, repeats: int = 5) -> float:
    """Best time (s) of ``[1, n_embd] x [n_embd, 12 n_embd]`` in float32 (see the module doc)."""
    rng = np.random.default_rng(0)  # fixed seed: the values do not matter, only the shape
    weights = rng.standard_normal((n_embd, 12 * n_embd), dtype=np.float32)
    x = rng.standard_normal((1, n_embd), dtype=np.float32)
    out = np.empty((1, 12 * n_embd), dtype=np.float32)
    np.matmul(x, weights, out=out)  # warm-up: page in the weights
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        np.matmul(x, weights, out=out)
        best = min(best, time.perf_counter() - start)
    return best


def measure_loopback_bandwidth(n_bytes: int = 16 * 1024 * 1024, chunk_bytes: int = 1024 * 1024) -> float:
    """Bytes per second through a connected socket pair (see the module doc)."""
    chunk = bytes(chunk_bytes)
    n_chunks = max(1, n_bytes // chunk_bytes)
    total = n_chunks * chunk_bytes
    left, right = socket.socketpair()
    try:

        def send() -> None:
            for _ in range(n_chunks):
                left.sendall(chunk)

        sender = threading.Thread(target=send, daemon=True)
        buffer = bytearray(chunk_bytes)
        start = time.perf_counter()
        sender.start()
        received = 0
        while received < total:
            n = right.recv_into(buffer)
            if n == 0:
                break
            received += n
        elapsed = time.perf_counter() - start
        sender.join()
    finally:
        left.close()
        right.close()
    return received / max(elapsed, 1e-9)


def probe_host(config: ProbeConfig | None = None, *, binary: str | os.PathLike | None = None) -> HostProbe:
    """Measure this host (blocking; takes well under a second with the default config).

    Raises:
      agent.io.worker.process.WorkerBinaryNotFound: no worker binary.
      subprocess.CalledProcessError / TimeoutExpired / ValueError: ``baton-worker --version``
        failed or printed something unexpected.
    """
    config = config or ProbeConfig()
    runtime = worker_runtime(binary, timeout_s=config.runtime_timeout_s)
    memory = psutil.virtual_memory()
    return HostProbe(
        os=f"{platform.system()} {platform.release()} ({platform.machine()})",
        cpu_model=cpu_model(),
        cpu_cores=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        ram_total_bytes=int(memory.total),
        ram_available_bytes=int(memory.available),
        devices=tuple(DeviceInfo(d.backend, d.name, d.total_bytes, d.free_bytes) for d in runtime.devices),
        llama_cpp_commit=runtime.llama_cpp_commit,
        patch_series_sha256=runtime.patch_series_sha256,
        architectures=RANGED_ARCHITECTURES,
        decode_s_per_block=measure_decode_s_per_block(config.reference_n_embd, config.decode_repeats),
        bandwidth_bytes_per_s=measure_loopback_bandwidth(config.bandwidth_bytes, config.bandwidth_chunk_bytes),
    )
