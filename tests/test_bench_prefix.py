"""The pure parts of bench/prefix.py: the time-to-first-token ratio, the conversation's prompt
rows over its unique tokens, the hit rates after each conversation's first turn, the markdown."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import prefix  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_ttft_is_the_ratio_of_the_medians() -> None:
    turns = [{"first_s": 2.0, "new_s": 0.2, "new_cached_tokens": 1472}, {"first_s": 4.0, "new_s": 0.3,
             "new_cached_tokens": 1472}, {"first_s": 3.0, "new_s": 1.0, "new_cached_tokens": 0}]  # fmt: skip
    s = prefix.summarise_ttft(turns)
    assert (s["first_s"], s["new_s"]) == (3.0, 0.3)
    assert s["ratio"] == pytest.approx(0.1) and s["met"]
    assert not prefix.summarise_ttft([{"first_s": 1.0, "new_s": 0.5, "new_cached_tokens": 0}])["met"]


def test_conversation_counts_prompt_rows_over_unique_tokens() -> None:
    # ten equal turns of 100 new tokens each (90 asked, 10 answered) without a cache: each turn
    # prefills every turn before it, 5.5x the 1,000 tokens less the answers not fed back
    turns = [{"prompt_tokens": 100 * k + 90, "completion_tokens": 10, "rows": 100 * k + 90 + 9} for k in range(10)]
    s = prefix.summarise_conversation(turns)
    assert s["prefilled_rows"] == sum(100 * k + 90 for k in range(10))
    assert s["unique_tokens"] == 1000
    assert s["ratio"] == pytest.approx(5.4)
    # with every earlier turn cached, each turn prefills its 100 new tokens (the first its 90)
    cached = [dict(t, rows=(90 if k == 0 else 100) + 9) for k, t in enumerate(turns)]
    assert prefix.summarise_conversation(cached)["ratio"] == pytest.approx(0.99)
    assert prefix.summarise_conversation([])["ratio"] is None


def test_hit_rates_leave_out_each_conversations_first_turn() -> None:
    sessions = [
        {"turn": 0, "prompt_tokens": 100, "cached_tokens": 0},
        {"turn": 0, "prompt_tokens": 100, "cached_tokens": 64},
        {"turn": 1, "prompt_tokens": 200, "cached_tokens": 128},
        {"turn": 1, "prompt_tokens": 200, "cached_tokens": 0},
        {"turn": 2, "prompt_tokens": 300, "cached_tokens": 256},
        {"turn": 2, "prompt_tokens": 300, "cached_tokens": 256},
    ]
    s = prefix.summarise_hits(sessions)
    assert s["later_turns"]["sessions"] == 4
    assert s["later_turns"]["session_hit_rate"] == pytest.approx(0.75)
    assert s["later_turns"]["token_hit_rate"] == pytest.approx(640 / 1000)
    assert s["first_turns"]["session_hit_rate"] == pytest.approx(0.5)
    assert not s["met"]
    assert prefix.summarise_hits([dict(x, cached_tokens=1) for x in sessions])["met"]


def test_markdown_names_each_section_and_its_target() -> None:
    ttft = [{"first_s": 2.0, "new_s": 0.2, "new_cached_tokens": 1472}]
    conversation = [{"prompt_tokens": 90, "completion_tokens": 10, "rows": 99}]
    hits = [{"turn": 1, "prompt_tokens": 100, "cached_tokens": 64}]
    report = {
        "quick": True,
        "ttft": {"loopback": {"system_tokens": 1500, "turns": ttft, "summary": prefix.summarise_ttft(ttft)}},
        "conversation": {"turns": 1, "on": {"summary": prefix.summarise_conversation(conversation)}},
        "hits": {"conversations": 16, "system_prompts": 4, "nodes": 6, "summary": prefix.summarise_hits(hits)},
    }
    text = prefix.markdown(report)
    assert "smoke run" in text
    assert "shared 1500-token system prompt (loopback)" in text and "**0.10x** the first's" in text and "met" in text
    assert "| on | 90 | 100 | 0.90x |" in text
    assert "| after each conversation's first turn | 1 | 100 % | 64 % |" in text
