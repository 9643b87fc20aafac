"""What the tracker's verifier shares with the rest of the tracker: its settings
(``VerifierConfig``), how its fresh identities get a transport (``OpenPersona``), how one
check ended (``CheckOutcome``), the totals (``VerifierStats``), and what it uses of the
tracker (``CanaryHost``).

Must not import ``agent.io.tracker.service`` or ``agent.io.tracker.integrity`` (they import
this module), nor the verifier's own modules (``verifier``, ``reference``, ``personas``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.node.worker_wait import AUTO, WAIT_CHOICES
from agent.core.tracker.canary import CanaryPolicy, CanarySchedule, OutputMismatch, RangeKey
from agent.io.net.transport import Transport

__all__ = ["CanaryHost", "CheckOutcome", "OpenPersona", "VerifierConfig", "VerifierStats"]

#: ``open_persona(key)``: an open transport whose identity is ``key`` (libp2p + the direct
#: channel in production, a ``MemoryTransport`` in unit tests).
OpenPersona = Callable[[Ed25519PrivateKey], AbstractAsyncContextManager[Transport]]


@dataclasses.dataclass(frozen=True)
class VerifierConfig:
    """The verifier's workers and deadlines (the canary policy is ``TrackerConfig.canary``).

    Fields:
      threads: threads of each reference worker.
      worker_wait: how a reference worker's idle threads wait (``agent.core.node.worker_wait``:
        auto, spin or sleep); auto sleeps after a short spin when nodes compute on this host.
      worker_binary: the baton-worker binary (None: ``find_worker_binary()``).
      worker_ready_timeout_s, worker_call_timeout_s: a reference worker's start and calls.
      max_reference_workers: reference workers kept at once (least recently used stopped
        first; at least 3, the chain of one check).
      step_timeout_s: how long a checked node may take to ack a canary step and push its output.
      persona_listen: where each fresh identity listens (nodes push outputs to it): the
        tracker's host, any port.
    """

    threads: int = 1
    worker_wait: str = AUTO
    worker_binary: str | None = None
    worker_ready_timeout_s: float = 120.0
    worker_call_timeout_s: float = 60.0
    max_reference_workers: int = 6
    step_timeout_s: float = 10.0
    persona_listen: str = "/ip4/127.0.0.1/tcp/0"

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.worker_wait not in WAIT_CHOICES:
            raise ValueError(f"worker_wait must be one of {', '.join(WAIT_CHOICES)}, got {self.worker_wait!r}")
        if self.max_reference_workers < 3:  # one check's chain: [0, b), [b, e), [e, L)
            raise ValueError(f"max_reference_workers must be >= 3, got {self.max_reference_workers}")
        for name in ("worker_ready_timeout_s", "worker_call_timeout_s", "step_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class CheckOutcome:
    """How one canary ended: ``passed``, ``failed`` (``mismatch`` is the evidence) or
    ``inconclusive`` (``reason``: the node refused or was too slow, the reference could not
    run). ``rows``: rows the checked node processed; ``node_s`` / ``reference_s``: time spent
    waiting for it / computing the reference."""

    key: RangeKey
    check_id: str
    status: str
    mismatch: OutputMismatch | None = None
    reason: str = ""
    steps: int = 0
    rows: int = 0
    node_s: float = 0.0
    reference_s: float = 0.0


@dataclasses.dataclass
class VerifierStats:
    """Totals over the verifier's checks (the benchmark reads them)."""

    passed: int = 0
    failed: int = 0
    inconclusive: int = 0
    rows: int = 0
    node_s: float = 0.0
    reference_s: float = 0.0

    def add(self, outcome: CheckOutcome) -> None:
        setattr(self, outcome.status, getattr(self, outcome.status) + 1)
        self.rows += outcome.rows
        self.node_s += outcome.node_s
        self.reference_s += outcome.reference_s


class CanaryHost(Protocol):
    """What the verifier uses of the tracker (``agent.io.tracker.service.Tracker``, which
    imports this module: it is not imported here)."""

    @property
    def canary_policy(self) -> CanaryPolicy | None: ...
    @property
    def canaries(self) -> CanarySchedule | None: ...
    @property
    def verifier_stats(self) -> VerifierStats: ...

    async def changed(self) -> None:
        """Returns when the tracker's state changed (a range may have become due)."""
        ...

    async def canary_target(self, key: RangeKey) -> tuple[tuple[str, ...], str, int, str]:
        """The checked node's addresses, the range's recipe hash, the model's block count and
        its registered file. Raises LookupError when the range is no longer served."""
        ...

    def issue_persona_admission(self, peer_id: str, role: swarm_pb2.Role) -> swarm_pb2.SignedAdmission:
        """An admission for one of the verifier's fresh identities."""
        ...

    def record_check(self, outcome: CheckOutcome) -> object:
        """Act on a check's outcome."""
        ...
