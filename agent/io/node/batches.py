"""A READY range's serving task (``BatchServing``): batches from the range's scheduler
(``agent.core.node.scheduler``), ONE worker Forward per batch, the output rows a non-last range
pushes kept per session (``agent.core.node.kept_rows``), then the outputs handed to ``Pushes``.

Hot path: protobuf bytes -> ``np.frombuffer`` view -> worker client; worker output ->
``tobytes``; no per-element Python, one Forward per batch. Must not import ``ranges``,
``data_plane``, ``sessions``, ``handlers`` or ``agent`` (they build on this module).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import trio

from agent.core.net.multiaddrs import tcp_hosts
from agent.core.node.policy import forward_failure, push_groups, sequence_not_held
from agent.core.node.range_states import range_name
from agent.core.node.scheduler import batch_window_wait_ms, decode_mode, first_hop_decode, gather_arrivals_needed
from agent.core.wire.boundary import BoundaryError
from agent.core.wire.step_requests import encode_step_output
from agent.core.wire.step_validation import StepInput
from agent.core.wire.worker_records import SeqInput, SeqOutput, WorkerInfo
from agent.io.local_host import is_this_host
from agent.io.worker.error import WorkerError
from agent.io.worker.process import WorkerHandle

from .pushes import Pushes
from .state import ServedRange, clock_ms, unbind_request

__all__ = ["BatchServing"]

log = logging.getLogger(__name__)


def _worker_top_k(step: StepInput, info: WorkerInfo) -> int:
    """K for the worker to select in C++: the step's ``result_top_k`` when this is the route's
    last hop and K is shorter than the row (then the reply carries K entries, not n_vocab
    floats); 0 (the full row) otherwise."""
    if step.rest or not info.gives_logits:
        return 0
    return step.result_top_k if 0 < step.result_top_k < info.n_vocab else 0


class BatchServing(Pushes):
    """Serves a range's batches on its worker (a part of ``agent.io.node.agent.Node``)."""

    async def _serve_batches(self, served: ServedRange, handle: WorkerHandle, pushes: trio.Nursery) -> str:
        """Forward batches until the worker dies (returns why); pushes run in ``pushes``."""
        assert served.scheduler is not None and served.sessions is not None and served.info is not None
        scheduler, sessions, info = served.scheduler, served.sessions, served.info
        client = handle.client
        timeout_s = self.config.worker_call_timeout_s
        gather_since_s: float | None = None  # when a first hop began holding a decode group
        while True:
            while not len(scheduler) and not sessions.has_closing():
                served.wakeup = trio.Event()
                await served.wakeup.wait()
            if window_ms := batch_window_wait_ms(self.config.batch_window_ms, scheduler.pending_rows, info.n_batch_max):
                await trio.sleep(window_ms / 1000)
            # both lists before any await: a session that ends meanwhile waits for the next pass,
            # so no sequence is freed before its session is unbound (no step reaches a reused one)
            unbinding, closing = sessions.take_unbinding(), sessions.take_closing()
            for session_id, seq_id in unbinding:
                try:
                    await client.call("UnbindSession", unbind_request(session_id), timeout_s=timeout_s)
                except WorkerError as err:
                    if (reason := self._exit_reason(handle)) is not None:
                        return reason
                    log.warning("%s: could not unbind session %s: %s", range_name(served.key), session_id.hex(), err)
                    closing.remove(seq_id)  # not reused: a step of it may still come
            for seq_id in closing:
                try:
                    await client.remove_sequence(seq_id, timeout_s=timeout_s)
                except WorkerError as err:
                    if (reason := self._exit_reason(handle)) is not None:
                        return reason
                    if not sequence_not_held(err.code_name):
                        log.warning("%s: could not free sequence %d: %s", range_name(served.key), seq_id, err)
                        continue  # not reused: it may still hold positions
                sessions.release(seq_id)
            oldest, waiting = scheduler.decode_waiting()
            now_s = trio.current_time()
            gather_since_s = now_s if gather_since_s is None else gather_since_s
            groups, window_ms = self._decode_mode(
                tcp_hosts(oldest[1].rest[0].addrs) if oldest and oldest[1].rest else []
            )
            max_decode, hold_ms = first_hop_decode(
                begin=served.key[1], decoding_sessions=sessions.decoding_count,
                route_hops=len(oldest[1].rest) + 1 if oldest else 0,
                groups=groups, waiting=waiting, waited_ms=(now_s - gather_since_s) * 1000, window_ms=window_ms,
            )  # fmt: skip
            if hold_ms > 0:
                served.wakeup = trio.Event()
                # decode steps that cannot complete the group do not wake this task
                served.quiet_decode_arrivals = gather_arrivals_needed(waiting, max_decode or 1) - 1
                with trio.move_on_after(hold_ms / 1000):
                    await served.wakeup.wait()  # the group may be whole, or something else came: count again
                served.quiet_decode_arrivals = 0
                continue
            gather_since_s = None
            batch = scheduler.next_batch(max_decode_entries=max_decode)
            if not batch:
                continue
            altering = self._outputs_filter is not None and self._outputs_filter.batch_formed()
            entries = [
                SeqInput(
                    seq_id=seq_id,
                    positions=step.positions,
                    token_ids=step.token_ids,
                    boundary=step.rows,
                    boundary_schema=step.schema if step.rows is not None else None,
                    # (a test hook) an altered last range selects its top-K from the altered row
                    top_k=0 if altering else _worker_top_k(step, info),
                    boundary_bytes=step.wire_rows,
                )
                for seq_id, step in batch
            ]
            served.in_forward = batch
            try:
                outputs = await client.forward(entries, timeout_s=timeout_s)
                if len(outputs) != len(entries):
                    raise WorkerError(
                        "INTERNAL", f"{len(entries)} entries sent, {len(outputs)} returned", method="Forward"
                    )
            except (WorkerError, BoundaryError, ValueError) as err:
                served.in_forward = []
                now = clock_ms()
                self._forward_finished(served)
                failure = forward_failure(getattr(err, "code_name", ""), str(err), self.peer_id)
                for _seq_id, step in batch:
                    sessions.done(step.session_id, now)
                    if failure.end_session:
                        served.end_session(step.session_id)
                    pushes.start_soon(self._guarded, self._fail, step, failure)
                if (reason := self._exit_reason(handle)) is not None:
                    return reason
                continue
            served.in_forward = []
            served.forward_calls += 1
            served.entries_forwarded += len(batch)
            if (timing := client.last_forward) is not None:
                served.forward_compute_us += timing.compute_us
                served.forward_call_us += timing.call_us
            served.largest_batch = max(served.largest_batch, len(batch))
            now = clock_ms()
            done: list[tuple[StepInput, SeqOutput, tuple[bytes, int] | None]] = []
            for (_seq_id, step), output in zip(batch, outputs, strict=True):
                sessions.done(step.session_id, now)
                if step.session_id not in sessions:
                    continue  # ended while in the Forward: nobody wants the output
                if self._outputs_filter is not None:
                    output = self._outputs_filter.apply(step, output, altering=altering)
                done.append((step, output, self._keep_rows(served, step, output)))
            # the same peer at the same addresses: a step's addresses come from its owner's route
            next_hops = [
                (step.rest[0].peer_id, tuple(step.rest[0].addrs)) if step.rest else None for step, _o, _e in done
            ]
            for group in push_groups(next_hops):
                if self._push_now([done[i] for i in group], pushes):
                    continue
                if len(group) == 1:
                    pushes.start_soon(self._guarded, self._push, *done[group[0]])
                else:
                    pushes.start_soon(self._guarded, self._push_batch, [done[i] for i in group])
            self._forward_finished(served)

    @staticmethod
    def _forward_finished(served: ServedRange) -> None:
        served.forward_done.set()
        served.forward_done = trio.Event()

    @staticmethod
    def _keep_rows(served: ServedRange, step: StepInput, output: SeqOutput) -> tuple[bytes, int] | None:
        """Keep the output rows a non-last range produced for ``step`` (before they are
        pushed: a resume may need them whatever happens to the push); returns them encoded
        for the wire (``(bytes, dtype)``, which the push sends as they are), or None."""
        if served.kept is None or output.boundary is None or served.info is None or served.info.gives_logits:
            return None
        try:
            data, dtype = encode_step_output(step, output.boundary, output.boundary_bytes)
        except BoundaryError:
            return None  # the push reports it
        schema = step.schema
        served.kept.keep(
            step.session_id, step.first_position, step.n_rows, data,
            dtype=dtype, schema_version=schema.version, streams=schema.streams,
        )  # fmt: skip
        return data, dtype

    @staticmethod
    def _exit_reason(handle: WorkerHandle) -> str | None:
        code = handle.process.poll()
        if code is None:
            return None
        return f"worker exited with code {code}: {handle.log_tail(400)}"

    def _decode_mode(self, next_hop_hosts: Sequence[str]) -> tuple[int | None, float]:
        """This node's decode groups and gather window as a first hop of a route whose next hop
        is at ``next_hop_hosts`` (none: no next hop): ``agent.core.node.scheduler.decode_mode``, told
        whether that hop runs on this machine."""
        shares = any(map(is_this_host, next_hop_hosts))
        return decode_mode(self.config.decode_groups, self.config.decode_gather_ms, next_hop_shares_host=shares)
