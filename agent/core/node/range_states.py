"""The ranges one node serves and their lifecycle, as a state machine: events in, actions out.

Owns, for one node (``agent.io.node.agent`` performs the actions):
- the tracker's directives: LOAD of a range not held (or held FAILED: it is started afresh)
  opens it LOADING and starts its task (fetching the model's bytes first when the file is not
  on this node and fetching is allowed, else checking the local file), unless it can never
  load here (the model is not on this node and nothing may be fetched, or the blocks are not
  a range): then it is FAILED at once with the reason; LOAD of a range LOADING or READY
  changes nothing; UNLOAD stops and forgets it; a directive of an unknown kind is ignored
  with a warning;
- the range task's events: ``fetched`` (the model is local now), ``ready`` (the worker
  answers: READY with its recipe hash), ``worker_exited`` (a READY worker died: FAILED and
  stopped), ``stopped`` (the task ended: FAILED with why, or it was unloaded);
- what a stopped range owes: the steps still queued or in a Forward get an UNAVAILABLE error
  naming this node (``FailPending``), whoever stopped it;
- the state each range reports in heartbeats (``entry(key).state/error/recipe_hash``), and
  when the next heartbeat should go now (a range changed state).

Every range instance has an *epoch*: a range that is restarted (LOAD after FAILED) or
unloaded and loaded again is a new instance, and the events of the old one's task (which may
still be ending) change nothing of the new one.

Pure: no clock, no I/O. Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from agent._proto import swarm_pb2

__all__ = [
    "Action",
    "FailPending",
    "HeartbeatNow",
    "Ignored",
    "RangeBook",
    "RangeEntry",
    "RangeKey",
    "StartRange",
    "StopRange",
    "range_name",
]

State = swarm_pb2.AssignmentStatus.State
RangeKey = tuple[str, int, int]  # (model sha256, begin, end)


def range_name(key: RangeKey) -> str:
    return f"model {key[0][:12]} blocks [{key[1]}, {key[2]})"


@dataclasses.dataclass
class RangeEntry:
    """One range instance: what it reports to the tracker."""

    key: RangeKey
    epoch: int
    state: int = State.LOADING
    error: str = ""
    recipe_hash: str = ""  # the worker's, once READY
    running: bool = False  # its task was started and has not reported ``stopped``


@dataclasses.dataclass(frozen=True)
class StartRange:
    """Start the range's task: fetch the model's bytes first (``fetch``), or check the local
    file (``verify_local``), then start its worker; report the task's events with ``epoch``."""

    key: RangeKey
    epoch: int
    fetch: bool
    verify_local: bool


@dataclasses.dataclass(frozen=True)
class StopRange:
    """Cancel the task of range instance ``(key, epoch)`` (its worker is stopped)."""

    key: RangeKey
    epoch: int


@dataclasses.dataclass(frozen=True)
class FailPending:
    """Every step still queued or in a Forward on range instance ``(key, epoch)`` gets an
    UNAVAILABLE error with ``message`` naming this node as the failed peer."""

    key: RangeKey
    epoch: int
    message: str


@dataclasses.dataclass(frozen=True)
class HeartbeatNow:
    """Send the next heartbeat now: a range changed state."""


@dataclasses.dataclass(frozen=True)
class Ignored:
    """Nothing done; ``warning`` says why (for the log)."""

    warning: str


Action = StartRange | StopRange | FailPending | HeartbeatNow | Ignored
HEARTBEAT_NOW = HeartbeatNow()


class RangeBook:
    """The node's ranges. Each method takes one event and returns the actions to perform.

    Args:
      local_models: sha256s of the GGUF files this node has.
      fetches_models: whether the node may fetch the bytes of models it lacks.
      verify_local_models: whether a local file's range is checked against the tracker's
        manifest before it is served.
      peer_id: this node's peer id (named in the errors of steps a stopped range owed).
    """

    def __init__(
        self, local_models: Iterable[str], *, fetches_models: bool, verify_local_models: bool, peer_id: str
    ) -> None:
        self.local_models = set(local_models)
        self.fetches_models = fetches_models
        self.verify_local_models = verify_local_models
        self.peer_id = peer_id
        self._entries: dict[RangeKey, RangeEntry] = {}
        self._stopping: dict[tuple[RangeKey, int], RangeEntry] = {}  # stopped, task still ending
        self._epochs = 0

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[RangeEntry]:
        return iter(list(self._entries.values()))

    def entry(self, key: RangeKey) -> RangeEntry | None:
        return self._entries.get(key)

    def instance(self, key: RangeKey, epoch: int) -> RangeEntry | None:
        """The entry of range instance ``(key, epoch)``: held, or stopped with its task still
        ending (None once it ended, or for an epoch never opened)."""
        entry = self._entries.get(key)
        if entry is not None and entry.epoch == epoch:
            return entry
        return self._stopping.get((key, epoch))

    # --- directives -------------------------------------------------------------------

    def directive(self, kind: int, key: RangeKey) -> list[Action]:
        """A LOAD or UNLOAD directive from the tracker for ``key``."""
        if kind == swarm_pb2.Directive.LOAD:
            return self._load(key)
        if kind == swarm_pb2.Directive.UNLOAD:
            entry = self._entries.pop(key, None)
            if entry is None:
                return []
            return [*self._stop(entry), HEARTBEAT_NOW]
        return [Ignored(f"directive of unknown kind {kind} for {range_name(key)}")]

    def _load(self, key: RangeKey) -> list[Action]:
        current = self._entries.get(key)
        if current is not None and current.state != State.FAILED:
            return []  # already loading or serving it
        actions: list[Action] = [] if current is None else self._stop(current)
        self._epochs += 1
        entry = RangeEntry(key=key, epoch=self._epochs)
        self._entries[key] = entry
        model_sha256, begin, end = key
        local = model_sha256 in self.local_models
        if not local and not self.fetches_models:
            entry.state, entry.error = State.FAILED, f"model {model_sha256} is not on this node"
        elif not 0 <= begin < end:
            entry.state, entry.error = State.FAILED, f"bad range [{begin}, {end})"
        else:
            entry.running = True
            actions.append(
                StartRange(key, entry.epoch, fetch=not local, verify_local=local and self.verify_local_models)
            )
        actions.append(HEARTBEAT_NOW)
        return actions

    def _stop(self, entry: RangeEntry) -> list[Action]:
        """Stop a held instance (unloaded or replaced): its task is cancelled; it stays known
        until its task reports ``stopped``."""
        if not entry.running:
            return []  # it never started a task, or the task ended: nothing to stop
        self._stopping[(entry.key, entry.epoch)] = entry
        return [StopRange(entry.key, entry.epoch)]

    # --- the range task's events --------------------------------------------------------

    def fetched(self, key: RangeKey, epoch: int) -> list[Action]:
        """The model's bytes for the range are on this node now."""
        self.local_models.add(key[0])
        return [HEARTBEAT_NOW] if self.instance(key, epoch) is not None else []

    def ready(self, key: RangeKey, epoch: int, recipe_hash: str) -> list[Action]:
        """The range's worker started and answers."""
        entry = self._entries.get(key)
        if entry is None or entry.epoch != epoch or entry.state != State.LOADING:
            return []  # unloaded or replaced while it started: its task is being cancelled
        entry.state, entry.error, entry.recipe_hash = State.READY, "", recipe_hash
        return [HEARTBEAT_NOW]

    def worker_exited(self, key: RangeKey, epoch: int, reason: str) -> list[Action]:
        """The worker of a READY range is gone (seen between Forwards or at a heartbeat): the
        range FAILED and its task stops."""
        entry = self._entries.get(key)
        if entry is None or entry.epoch != epoch or entry.state != State.READY:
            return []
        entry.state, entry.error = State.FAILED, reason
        self._stopping[(key, epoch)] = entry
        return [StopRange(key, epoch), HEARTBEAT_NOW]

    def stopped(self, key: RangeKey, epoch: int, error: str) -> list[Action]:
        """The range instance's task ended: it failed with ``error`` (it could not start, or
        its worker died), or it was cancelled (``error`` empty: unloaded, replaced, or
        stopped after ``worker_exited``). Steps it still held are owed an error."""
        entry = self.instance(key, epoch)
        self._stopping.pop((key, epoch), None)
        if entry is None or not entry.running:
            return []
        entry.running = False
        if error and entry.state != State.FAILED:
            entry.state, entry.error = State.FAILED, error
        elif entry.state != State.FAILED:
            entry.state, entry.error = State.FAILED, "unloaded"
        held = self._entries.get(key) is entry
        actions: list[Action] = [FailPending(key, epoch, f"{range_name(key)} stopped on {self.peer_id}: {entry.error}")]
        if held:
            actions.append(HEARTBEAT_NOW)
        return actions
