"""The pure parts of bench/batching.py: the summary against llama-batched-bench (the default
mode, decode groups off and decode groups on, side by side) and its markdown."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import batching  # noqa: E402
from tools import hop_trace  # noqa: E402

pytestmark = pytest.mark.worker


def test_the_summary_takes_ratios_of_both_modes_checks_the_doublings_and_the_gap_target() -> None:
    baton = {
        "parallel": {n: {"tokens_per_s": t} for n, t in ((1, 20.0), (2, 35.0), (4, 30.0), (8, 60.0))},
        "gaps": {
            "alone": batching._percentiles([0.03, 0.03, 0.04]),
            "during_prefill": batching._percentiles([0.05, 0.05, 0.05, 0.5]),
            "prefill_s": 2.0, "long_prompt_tokens": 1500, "chunk_rows": 128,
        },
    }  # fmt: skip
    # groups off rises with every doubling: the targets are the default mode's all the same
    off = {"parallel": {n: {"tokens_per_s": t} for n, t in ((1, 20.0), (2, 25.0), (4, 28.0), (8, 40.0))}}
    llama = {n: {"speed_tg": 25.0 * n} for n in batching.PARALLEL}
    summary = batching.summarize(baton, llama, off)
    assert [round(r["ratio"], 2) for r in summary["rows"]] == [0.8, 0.7, 0.3, 0.3]
    assert [round(r["groups_off_ratio"], 2) for r in summary["rows"]] == [0.8, 0.5, 0.28, 0.2]
    assert [round(r["default_over_off"], 2) for r in summary["rows"]] == [1.0, 1.4, 1.07, 1.5]
    assert (summary["ratio_at_8"], summary["groups_off_ratio_at_8"], summary["default_over_off_at_8"]) == (
        0.3,
        0.2,
        1.5,
    )
    assert summary["rising_with_every_doubling"] is False  # 4 sessions fell below 2
    assert summary["gap_p99_over_p50_during_prefill"] == 10.0
    report = {
        "summary": summary, "baton": baton, "wall_time_s": 1.0, "machine": {"cpu_model": "cpu", "cores": 2},
        "config": {"threads": 1, "prompt": 64, "tokens": 48, "llama_threads": 2},
    }  # fmt: skip
    md = batching.render_markdown(report)
    assert "| 8 | 200.0 | 60.0 | 0.30x | 40.0 | 0.20x | 1.50x |" in md
    assert "8 sessions, default: 0.30x llama-batched-bench (target >= 0.8x): missed by 0.50x;" in md
    assert "groups off: 0.20x; default / off: 1.50x." in md
    assert "rising with every doubling (default): no" in md
    assert "= 10.00x p50 (target <= 2.0x: missed)" in md
    assert "over the whole span instead" not in md  # (a report from before the span column)
    for n, row in baton["parallel"].items():
        row["span_tokens_per_s"] = 10.0 * n
    summary = batching.summarize(baton, llama, off)
    assert (summary["span_ratio_at_8"], summary["span_rising_with_every_doubling"]) == (0.4, True)
    md = batching.render_markdown({**report, "summary": summary})
    assert "| 8 | 200.0 | 60.0 | 0.30x | 40.0 | 0.20x | 1.50x | 80.0 (0.40x) |" in md
    assert "over the whole span instead: 0.40x at 8 sessions, rising with every doubling: yes." in md


def test_decode_groups_get_their_own_columns_ratio_and_doublings_beside_the_default() -> None:
    tps = lambda *ts: {"parallel": {n: {"tokens_per_s": t} for n, t in zip(batching.PARALLEL, ts)}}  # noqa: E731
    baton = {**tps(20.0, 35.0, 40.0, 60.0), "gaps": {"alone": {"n": 0}, "during_prefill": {"n": 0}}}
    llama = {n: {"speed_tg": 25.0 * n} for n in batching.PARALLEL}
    summary = batching.summarize(baton, llama, tps(20.0, 25.0, 28.0, 40.0), tps(20.0, 40.0, 70.0, 170.0))
    assert (round(summary["groups_ratio_at_8"], 2), summary["groups_rising_with_every_doubling"]) == (0.85, True)
    assert summary["ratio_at_8"] == 0.3, "the targets stay the default mode's"
    report = {
        "summary": summary, "baton": baton, "wall_time_s": 1.0, "machine": {"cpu_model": "cpu", "cores": 2},
        "config": {"threads": 1, "prompt": 64, "tokens": 48, "llama_threads": 2, "default_threads": 2},
    }  # fmt: skip
    md = batching.render_markdown(report)
    assert "| Baton, groups of 4: decode t/s | ratio |" in md
    assert "workers of 2 threads, the cores" in md
    assert "| 8 | 200.0 | 60.0 | 0.30x | 40.0 | 0.20x | 1.50x | — | 170.0 | 0.85x |" in md
    assert "- decode groups (as on separate machines): 0.85x at 8 sessions (above the target), rising with every" in md
    summary = batching.summarize(baton, llama, tps(20.0, 25.0, 28.0, 40.0), tps(20.0, 40.0, 30.0, 100.0))
    md = batching.render_markdown({**report, "summary": summary})
    assert "- decode groups (as on separate machines): 0.50x at 8 sessions (0.30x under the target), rising with" in md
    assert "doubling: no." in md


def test_the_all_decoding_window_runs_from_the_last_first_token_to_the_first_last_token() -> None:
    # session a decodes from t=0 to t=10, one token a second; b's prompt ends at 4, b is done at 8
    a = [float(t) for t in range(11)]
    b = [4.0, 5.0, 6.0, 7.0, 8.0]
    # window (4, 8]: a's tokens at 5, 6, 7, 8 and b's at 5, 6, 7, 8
    assert batching.all_decoding([a, b]) == (8, 4.0)
    assert batching.all_decoding([a]) == (10, 10.0)  # one session: its whole decode
    with pytest.raises(ValueError, match="never all decoded at once"):
        batching.all_decoding([[0.0, 1.0, 2.0], [3.0, 4.0]])


def test_the_cpu_table_is_per_generated_token_and_sums_every_process() -> None:
    run = {
        "sessions": 8, "decode_tokens": 792, "wall_s": 10.0,  # 800 tokens generated, prompt's first included
        "cpu_s": {"worker [0-10]": 4.0, "worker [20-30]": 8.0, "node agents (Python)": 2.0, "owners (this process, Python)": 1.0},
    }  # fmt: skip
    off = {**run, "cpu_s": {**run["cpu_s"], "worker [20-30]": 10.0}}
    report = {
        # 8 x 50 tokens in 1 + 3 s with 2 threads: 20 ms of CPU a generated token, prompt included
        "llama_batched_bench": {"8": {"speed_tg": 133.3, "t_pp": 1.0, "t_tg": 3.0, "pl": 8, "tg": 50}},
        "config": {"llama_threads": 2},
        "baton": {"parallel": {"8": run}}, "baton_decode_groups_off": {"parallel": {"8": off}},
    }  # fmt: skip
    lines = batching._cpu_table(report)
    assert "llama-batched-bench: 20.0 ms with its 2 threads busy for its prefill and decode" in lines[1]
    assert "| worker [20-30] | 10.0 | 12.5 |" in lines
    assert "| all | 18.8 | 21.2 |" in lines
    assert "| cores busy on average | 1.50 | 1.70 |" in lines
    grouped = {**run, "cpu_s": {**run["cpu_s"], "worker [0-10]": 2.0}}
    lines = batching._cpu_table({**report, "baton_decode_groups": {"parallel": {"8": grouped}}})
    assert "| process | default | groups off | groups of 4 |" in lines
    assert "| worker [0-10] | 5.0 | 5.0 | 2.5 |" in lines
    assert batching._cpu_table({"baton": {"parallel": {"8": {"tokens_per_s": 1.0}}}}) == []
    assert batching._role(["/x/baton-worker", "--model", "m", "--layers", "10-20"]) == "worker [10-20]"


def _forward(t_in: int, compute: int, entries: int) -> list[tuple[int, str, int]]:
    """A node's events of one Forward: ``fwd_in`` (entries), the exchange, ``fwd_out`` (ms)."""
    ms = 1_000_000
    return [
        (t_in * ms, "fwd_in", entries), ((t_in + 1) * ms, "call_in", 0),
        ((t_in + 1 + compute) * ms, "call_out", 0), ((t_in + 2 + compute) * ms, "fwd_out", 0),
    ]  # fmt: skip


def test_a_lock_step_round_is_split_into_exchanges_handoffs_and_the_loop_back() -> None:
    # two rounds of 8 through 3 hops; prefill Forwards of 1 entry in between are not rounds.
    # round 1: hop 1 exchange 1..11, hop 2 13..25, hop 3 28..48; round 2 starts at 51
    hop1 = _forward(0, 10, 8) + _forward(40, 3, 1) + _forward(50, 10, 8)
    hop2 = _forward(12, 12, 8) + _forward(62, 12, 8)
    hop3 = _forward(27, 20, 8) + _forward(77, 20, 8)
    out = hop_trace.round_breakdown([hop1, hop2, hop3], 8)
    assert out["rounds"] == 2 and out["entries"] == 8
    assert out["exchange_ms"] == pytest.approx([10.0, 12.0, 20.0])
    assert out["handoff_ms"] == pytest.approx([2.0, 3.0])
    # only round 1 has a next round in the trace: the last hop's reply at 48, the next at 51
    assert out["loop_ms"] == pytest.approx(3.0)
    assert out["round_ms"] == pytest.approx(50.0)
    # the prefill Forward (1 entry) is seen as a Forward, not as a round's
    assert [f["entries"] for f in hop_trace.node_forwards(hop1)] == [8, 1, 8]
    assert hop_trace.round_breakdown([hop1, [], hop3], 8) == {"rounds": 0}


def test_a_span_is_cut_at_the_first_or_last_event_of_each_stage_and_a_missing_one_merges_forward() -> None:
    ms = 1_000_000
    stages = (("a", "from", "x", "first"), ("b", "to", "y", "last"), ("c", "to", "z", "first"))
    sender = [(1 * ms, "x", 0), (3 * ms, "x", 0), (50 * ms, "x", 0)]  # 50: after the span
    receiver = [(0, "y", 0), (4 * ms, "y", 0), (6 * ms, "y", 0), (7 * ms, "z", 0), (9 * ms, "z", 0)]
    # a ends at the first x (1), b at the last y in the span (6), c at the first z after it (7)
    assert hop_trace.span_stages(sender, receiver, 0, 10 * ms, stages) == pytest.approx([1.0, 5.0, 1.0])
    # no y in the span: b is None and c counts from where a ended
    assert hop_trace.span_stages(sender, [(7 * ms, "z", 0)], 0, 10 * ms, stages) == [
        pytest.approx(1.0),
        None,
        pytest.approx(6.0),
    ]
    # an event before the span's start is not the stage's end
    assert hop_trace.span_stages(sender, receiver, 2 * ms, 10 * ms, stages) == pytest.approx([1.0, 3.0, 1.0])


def test_the_round_breakdown_cuts_handoffs_and_the_loop_into_stages() -> None:
    ms = 1_000_000
    hop1 = _forward(0, 10, 8) + _forward(50, 10, 8)
    hop2 = _forward(13, 12, 8) + _forward(63, 12, 8)
    hop3 = _forward(28, 20, 8) + _forward(78, 20, 8)
    # round 1's hand-off hop 1 -> hop 2 (call_out 11 .. call_in 14): reply decoded by 12, push
    # at 12.2, frame written 12.4-12.5, read at 12.6, two steps accepted by 12.9, fwd_in 13;
    # round 2's hand-off has no push, frame or step events
    hop1 += [(int(12.2 * ms), "push_in", 0), (int(12.4 * ms), "wr_in", 0), (int(12.5 * ms), "wr_out", 0)]
    hop2 += [(int(12.6 * ms), "rd_in", 0), (int(12.7 * ms), "accept_out", 0), (int(12.9 * ms), "accept_out", 0)]
    hop1, hop2 = sorted(hop1), sorted(hop2)
    out = hop_trace.round_breakdown([hop1, hop2, hop3], 8)
    first, _second = out["handoff_stages_ms"]
    assert [row[0] for row in first] == [stage[0] for stage in hop_trace.HANDOFF_STAGES]
    got = {what: (value, found) for what, value, found in first}
    assert got["sender: the worker's reply decoded"] == (pytest.approx(1.0), 2)
    assert got["sender: outputs taken (rows kept, push groups)"] == (pytest.approx(0.2), 1)
    assert got["sender: the frame written (TLS, socket)"] == (pytest.approx(0.1), 1)
    assert got["receiver: the step handlers, every step of the batch"] == (pytest.approx(0.3), 1)
    # round 1: 12.9 -> 13; round 2, with nothing seen in between: fwd_out 62 -> fwd_in 63
    assert got["receiver: the serving task wakes and takes the batch"] == (pytest.approx(0.55), 2)
    assert got["receiver: the Forward request encoded and sent"] == (pytest.approx(1.0), 2)
    # the loop of round 1 (hop 3's reply at 49 to hop 1's next exchange at 51): decoded at 50,
    # then nothing but the first hop's fwd_in (50) and call_in (51)
    loop = {what: (value, found) for what, value, found in out["loop_stages_ms"]}
    assert [what for what, *_ in out["loop_stages_ms"]] == [stage[0] for stage in hop_trace.LOOP_STAGES]
    assert loop["last hop: the worker's reply decoded"] == (pytest.approx(1.0), 1)
    assert loop["owners: results taken, tokens chosen, until the first next step is accepted"] == (None, 0)
    assert loop["first hop: the Forward request encoded and sent"] == (pytest.approx(1.0), 1)


def test_forward_time_is_taken_between_two_counts_and_tabled_per_token_and_per_forward() -> None:
    before = {"[0:10]": (10, 40, 50_000, 60_000), "[10:20]": (10, 40, 40_000, 41_000)}
    after = {
        "[0:10]": (30, 200, 250_000, 290_000), "[10:20]": (10, 40, 40_000, 41_000), "[20:30]": (4, 8, 8_000, 10_000),
    }  # fmt: skip
    got = batching._forward_time(before, after)
    # [0:10]: 20 Forwards, 200 ms of worker time, 230 ms of calls: 1.5 ms a Forward beyond it
    assert got["[0:10]"] == {
        "forwards": 20, "compute_ms": 200.0, "call_ms": 230.0, "call_beyond_compute_ms_per_forward": 1.5,
    }  # fmt: skip
    assert "[10:20]" not in got  # no Forward in between
    assert got["[20:30]"]["call_beyond_compute_ms_per_forward"] == pytest.approx(0.5)  # new since: from 0
    run = {"decode_tokens": 92, "sessions": 8, "forward_time": got}  # 100 tokens
    lines = batching._forward_time_table({"baton": {"parallel": {"8": run}}})
    assert "| [0:10] | 2.00 | 1.50 |" in lines
    assert "| [20:30] | 0.08 | 0.50 |" in lines
    assert batching._forward_time_table({"baton": {"parallel": {"8": {"tokens_per_s": 1.0}}}}) == []
    assert batching._steps_per_forward(before, after) == {"[0:10]": 8.0, "[20:30]": 2.0}


def test_the_workers_own_time_in_the_trace_is_read_at_fwd_out() -> None:
    ms = 1_000_000
    events = _forward(0, 10, 8)
    events[-1] = (events[-1][0], "fwd_out", 9_500)  # the worker said 9.5 ms
    (forward,) = hop_trace.node_forwards(events)
    assert forward["compute_us"] == 9_500 and forward["entries"] == 8
    chain = [(0, "fwd_in", 1), (ms, "fwd_out", 4_000), (2 * ms, "fwd_in", 1), (3 * ms, "fwd_out", 6_000)]
    assert hop_trace.compute_times(chain, 2) == pytest.approx([4.0, 6.0])


def test_rounds_merge_into_each_figures_median_round_and_list_every_round() -> None:
    rows = [{"tokens_per_s": 90.0, "cpu_s": {"a": 1.0}}, {"tokens_per_s": 70.0, "cpu_s": {"a": 2.0}},
            {"tokens_per_s": 80.0, "cpu_s": {"a": 3.0}}]  # fmt: skip
    # the median round's whole row (its CPU too), every round's t/s in round order
    assert batching.median_round(rows, "tokens_per_s") == {"tokens_per_s": 80.0, "cpu_s": {"a": 3.0},
                                                           "rounds_tokens_per_s": [90.0, 70.0, 80.0]}  # fmt: skip
    assert batching.median_round(rows[:2], "tokens_per_s")["tokens_per_s"] == 70.0  # even: the lower middle
    runs = [
        {"parallel": {8: rows[0], 1: {"tokens_per_s": 5.0}}},
        {"parallel": {8: rows[1], 1: {"tokens_per_s": 6.0}}, "gaps": {"n": 3}},
        {"parallel": {8: rows[2], 1: {"tokens_per_s": 4.0}}},
    ]
    merged = batching.median_run(runs)
    assert merged["gaps"] == {"n": 3}  # measured in one round only
    assert merged["parallel"][8]["tokens_per_s"] == 80.0 and merged["parallel"][1]["tokens_per_s"] == 5.0
    report = {
        "llama_batched_bench": {"8": {"rounds_speed_tg": [150.0, 160.0, 170.0]}},
        "baton": {"parallel": {"8": {"rounds_tokens_per_s": [90.0, 70.0, 80.0]}}},
    }
    assert batching._rounds_line(report) == [
        "", "- each round at 8 sessions, t/s in round order: llama-batched-bench 150.0, 160.0, 170.0; "
        "default 90.0, 70.0, 80.0.",
    ]  # fmt: skip
    report["baton"]["parallel"]["8"]["rounds_tokens_per_s"] = [80.0]
    assert batching._rounds_line(report) == []


def test_bare_exchanges_are_per_range_medians_of_every_call() -> None:
    ms = 1_000_000
    events, t = [], 0
    for compute in (5, 7, 6, 9, 4, 8):  # ranges 0, 1, 0, 1, 0, 1
        events += [(t, "call_in", 0), (t + compute * ms, "call_out", 0)]
        t += 20 * ms
    assert hop_trace.exchange_times(events, 2) == pytest.approx([5.0, 8.0])
    assert hop_trace.exchange_times([], 2) == []


def test_the_rounds_table_puts_the_swarm_beside_bare_workers_and_sums_the_rest() -> None:
    rounds = {
        "rounds": 3, "entries": 8, "passes": 3, "ranges": [[0, 10], [10, 20], [20, 30]], "round_ms": 51.0,
        "compute_ms": [10.0, 12.0, 20.0], "steps_per_forward": [7.5, 7.5, 8.0],
        "bare_exchange_ms": [9.0, 10.0, 17.0], "bare_compute_ms": [8.0, 9.0, 16.0], "llama_step_ms": 30.0,
    }  # fmt: skip
    lines = batching._rounds_table({"baton": {"rounds": rounds}})
    assert "| worker [0:10]: its Forwards' own time (swarm: 7.50 steps a Forward) | 10.00 | 8.00 |" in lines
    # the rest: 51 - 42 in the swarm, 36 - 33 bare
    assert any(line.startswith("| the rest:") and line.endswith("| 9.00 | 3.00 |") for line in lines)
    assert "| the round | 51.00 | 36.00 |" in lines
    assert "| llama-batched-bench unsplit: a step of 8 sequences as far (interleaved) | — | 30.00 |" in lines
    # 30 / 51 = 0.59x, 30 / 36 = 0.83x; 42 ms of own time against 33 (1.27x)
    assert "round is 0.59x llama-batched-bench's speed, the bare workers' 0.83x" in lines[-1]
    assert "42.0 ms a round in the swarm against 33.0 bare (1.27x)" in lines[-1]
    assert batching._rounds_table({"baton": {"rounds": None}}) == []
    failed = batching._rounds_table({"baton": {"rounds": {"rounds": 0, "error": "no decode step"}}})
    assert "not measured (no decode step)" in failed[-1]
