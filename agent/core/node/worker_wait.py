"""How a CPU worker's idle threads wait for work: spin, or sleep in the kernel.

Owns the choice of the worker's OpenMP wait policy, for ``agent.io.node.ranges`` (which counts
the Baton workers already running on the host and starts the worker with the environment
chosen here).

Why it matters: llama.cpp's CPU backend runs each graph on an OpenMP team; between two
graphs, and at each barrier inside one, a waiting thread of libgomp spins (300,000 rounds by
default, some milliseconds) before it sleeps. A worker alone on its machine gains by that: its
next Forward starts on threads that are already awake. Several workers on one machine's cores
lose by it: a worker that just finished spins on the cores the next hop now needs, and two
workers computing at once spin at every barrier for a thread the other holds off its core.
But never spinning (``OMP_WAIT_POLICY=PASSIVE``) loses too: every barrier inside a graph (a
few hundred a Forward, each some microseconds apart) then costs a futex sleep and wake-up, which
on a virtual machine takes longer than the wait itself. So ``sleep`` spins briefly first
(``GOMP_SPINCOUNT=SLEEP_SPIN_COUNT``, 1,000 rounds: ~25 us on the benchmark machine), enough
for the barriers inside a Forward, and sleeps through the gap between Forwards.

Measured on the 2-core benchmark machine (docs/PERFORMANCE.md, "Spin or sleep"; bare 2-thread
workers, medians of 3 interleaved rounds): one session through three workers in series decodes 2.2x faster with the short spin than with PASSIVE and 2.3x faster than spinning;
8 sessions through them in lock-step 1.17x and 1.24x. One worker alone decodes fastest spinning
(1.1x the short spin). Two 2-thread workers computing at once on 2 cores (8 sessions in two
groups in flight) is the one case where PASSIVE was ahead (1.10x): each spin there waits for a
thread that the other worker holds off its core, but 1,000 rounds bound what it wastes.
So the default (``auto``) sleeps when another Baton worker already computes on the host, or
another Baton node runs there (its worker may not have started yet), and spins otherwise;
``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set by the user are left as they are. A worker
started alone keeps spinning when other nodes start later (libgomp reads its policy once):
nodes meant to share a machine, started at different times, say ``sleep``.

A worker of one thread starts no OpenMP team: the choice does not change it.

Pure: no I/O (the environment and the count of other workers are passed in). Must not import
trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["AUTO", "SLEEP", "SLEEP_SPIN_COUNT", "SPIN", "WAIT_CHOICES", "worker_environment"]

AUTO = "auto"
SPIN = "spin"
SLEEP = "sleep"
WAIT_CHOICES = (AUTO, SPIN, SLEEP)

#: libgomp's spin rounds before a waiting thread sleeps, under ``sleep``: long enough to span
#: a barrier inside a Forward, short against the gap between two Forwards (one round is a
#: PAUSE and a load: ~25 ns on the benchmark machine's AMD EPYC, some 50 ns on Intel cores)
SLEEP_SPIN_COUNT = 1000

#: the variables libgomp reads for its wait policy (once, when the worker loads it)
_OMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def worker_environment(
    requested: str, *, other_workers: int, environment: Mapping[str, str], other_nodes: int = 0
) -> tuple[dict[str, str], str]:
    """The environment to start a worker with, and why (for the log).

    Args:
      requested: ``auto``, ``spin`` or ``sleep`` (the node's ``--worker-wait``). ``spin`` and
        ``sleep`` override the environment's wait variables; ``auto`` keeps them when set.
      other_workers: Baton workers already computing on this host, any node's or tracker's
        (``agent.io.worker.process.count_computing_workers`` sees its own user's: another
        user's worker dirs are private).
      environment: the node's own environment, which the worker inherits.
      other_nodes: other Baton node agents running on this host, whether or not their workers
        compute yet (``agent.io.worker.process.count_other_nodes``): nodes started together
        load their workers one after another, and the first, finding no worker, would spin
        for good (libgomp reads its policy once) on the cores its siblings are about to use.

    Raises:
      ValueError: ``requested`` is not one of ``WAIT_CHOICES``, or ``other_workers`` or
        ``other_nodes`` < 0.
    """
    if requested not in WAIT_CHOICES:
        raise ValueError(f"worker wait must be one of {', '.join(WAIT_CHOICES)}, got {requested!r}")
    for name, count in (("other_workers", other_workers), ("other_nodes", other_nodes)):
        if count < 0:
            raise ValueError(f"{name} must be >= 0, got {count}")
    env = dict(environment)
    if requested == AUTO:
        preset = [f"{name}={env[name]}" for name in _OMP_WAIT_VARIABLES if name in env]
        if preset:
            return env, f"as the environment says ({', '.join(preset)})"
        if other_workers == 0 and other_nodes == 0:
            return env, "spin (the only Baton worker on this host)"
        if other_workers:
            requested, why = SLEEP, f"{other_workers} other Baton worker(s) on this host"
        else:
            requested, why = SLEEP, f"{other_nodes} other Baton node(s) on this host"
    else:
        why = f"--worker-wait {requested}"
    for name in _OMP_WAIT_VARIABLES:
        env.pop(name, None)
    if requested == SLEEP:
        env["GOMP_SPINCOUNT"] = str(SLEEP_SPIN_COUNT)
    return env, f"{requested} ({why})"
