"""How the kernel schedules a Baton process: ``SCHED_BATCH`` (Linux), unless told otherwise.

Owns: one call, made at process start by every role's entry point (``agent.cli``) and by the
benchmarks' processes that stand in for Baton's (an owner, a direct harness), once for each
worker process (``agent.io.worker.process.open_worker``), and the way back to the kernel's
default for a program Baton starts that is not Baton's (``kernel_default``).

Why: a decode step is a chain of processes waking one another (owner, node agent, its
worker, the next node agent, ...), and on a machine whose cores they share (a volunteer's
desktop, several nodes on one box, this project's 2-core test VM) the kernel's default class
lets a woken process preempt the one that woke it at once: the sender of a frame is cut off
inside its ``send`` by the receiver, a worker's compute by a node's message, and both run
again later on colder caches. A ``SCHED_BATCH`` process never preempts on wake-up (the fair
scheduler's wake-up check leaves batch tasks to the tick): the waker finishes its few
microseconds of work and blocks, and the woken process runs then, or at once on an idle core.
A first measurement with ``bench/tools/step_ab.py`` (the two checkouts' swarms in turn; the nodes,
their workers, the tracker and the owners all batch on one side; docs/PERFORMANCE.md, "The batch
scheduling class"):
one session 1.076x tokens/s (ahead in 5 of 6 rounds; 1.05x, 5 of 6, in a first trial), 8
sessions lock-step 1.095x (ahead in 3 of 4). llama.cpp's RPC split gained nothing from the
class (3 alternating runs: 41.8, 42.5, 47.3 t/s default, 43.9, 34.9, 42.8 batch). It is also the
polite class on a volunteer's machine: Baton's compute never preempts the person's own
programs when it wakes (they still share the CPU by the usual fair weights).

Not replicated: on a later kernel build of the same VM (6.18.44-fc-v1252; the runs above were
on fc-v1098), the same A/B as two settings of one checkout (``step_ab --base-env
BATON_CPU_POLICY=normal``) read batch
against normal 0.969x tokens/s at one session (10 rounds, batch ahead in 2) and, lock-step at
8 sessions, 0.910x (6 rounds, behind in 6 on the decode step), then 1.003x (8 rounds, ahead in
5). Then long A/Bs settled it (rounds taken as pairs): batch against normal, one session, 20 rounds: the per-round ratio of tokens/s has its
median at 1.009 (95 % interval 0.956-1.046), batch ahead in 11 rounds and behind in 9 (sign
test p = 0.82); lock-step 8 sessions, 16 rounds: 1.013 (0.915-1.126), ahead in 9 and behind in
7 (p = 0.80). **The class does not change the speed measurably.** It stays the default for
the reason that does not need a benchmark: on a volunteer's machine, Baton's processes (the
workers' compute above all) never preempt the person's own programs when they wake.

``BATON_CPU_POLICY``: ``batch`` (the default) or ``normal`` (the kernel's default class). A
no-op (False) where the platform has no ``SCHED_BATCH`` (not Linux) or the kernel refuses it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

__all__ = ["ENV_VAR", "POLICIES", "apply_cpu_policy", "cpu_policy_from_env", "kernel_default"]

log = logging.getLogger(__name__)

ENV_VAR = "BATON_CPU_POLICY"
POLICIES = ("batch", "normal")


def cpu_policy_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The policy ``BATON_CPU_POLICY`` names (default ``batch``).

    Raises:
      ValueError: another value (the message says which are allowed).
    """
    value = (os.environ if environ is None else environ).get(ENV_VAR, "batch").strip().lower() or "batch"
    if value not in POLICIES:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(POLICIES)}")
    return value


def apply_cpu_policy(pid: int = 0, policy: str | None = None) -> bool:
    """Put process ``pid`` (0: this one; its later threads and children inherit it) in
    ``policy``'s scheduling class (None: ``cpu_policy_from_env()``). True when it took effect.

    Raises:
      ValueError: ``policy`` (or the environment's) is not one of ``POLICIES``.
    """
    policy = cpu_policy_from_env() if policy is None else policy
    if policy not in POLICIES:
        raise ValueError(f"CPU policy {policy!r}: expected one of {', '.join(POLICIES)}")
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None or not hasattr(os, "sched_setscheduler"):
        return False
    target = batch if policy == "batch" else os.SCHED_OTHER
    try:
        os.sched_setscheduler(pid, target, os.sched_param(0))
    except OSError as error:  # a sandbox that forbids it, a process already gone
        log.info("could not set the %s CPU policy on pid %d: %s", policy, pid or os.getpid(), error)
        return False
    return True


def kernel_default() -> None:
    """For ``subprocess``'s ``preexec_fn``: a program Baton starts that is not Baton's (the
    benchmarks' llama.cpp tools) runs in the kernel's default class, as its users run it,
    not in the batch class it would inherit."""
    if hasattr(os, "sched_setscheduler"):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
