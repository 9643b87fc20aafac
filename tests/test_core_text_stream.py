"""agent.core.owner.text_stream: whole UTF-8 characters at every boundary, stop strings cut exactly."""

from __future__ import annotations

import pytest

from agent.core.owner.text_stream import TextStream

pytestmark = pytest.mark.unit


def _run(pieces: list[bytes], stop: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    stream = TextStream(stop)
    out = []
    for piece in pieces:
        out.append(stream.feed(piece))
        if stream.stopped:
            break
    out.append(stream.finish())
    return out, stream


def test_emoji_and_cjk_split_inside_characters_come_out_whole() -> None:
    text = "héllo 🙂👍🏽 你好，世界"
    data = text.encode()
    pieces = [data[i : i + 1] for i in range(len(data))]  # every byte its own token
    out, stream = _run(pieces)
    assert "".join(out) == text
    for chunk in out:
        chunk.encode("utf-8")  # each chunk is valid on its own (no surrogates, no halves)
    assert all("\ufffd" not in chunk for chunk in out)
    assert stream.text == text


def test_an_unfinished_character_at_the_end_becomes_a_replacement() -> None:
    out, _ = _run([b"ok", "🙂".encode()[:2]])
    assert "".join(out) == "ok\ufffd"


def test_stop_string_spanning_tokens_is_cut_exactly() -> None:
    out, stream = _run([b"Hello", b" wor", b"ld", b"! more"], stop=("world",))
    assert "".join(out) == "Hello "
    assert stream.stopped and stream.stop_string == "world"
    assert stream.feed(b"after") == "" and stream.finish() == ""


def test_text_that_might_start_a_stop_is_held_then_released() -> None:
    stream = TextStream(["\n\nUser:"])
    assert stream.feed(b"a\n") == "a"
    assert stream.feed(b"\nUs") == ""  # could still become the stop string
    assert stream.feed(b"ed") == "\n\nUsed"  # it did not
    assert not stream.stopped


def test_the_earliest_of_several_stops_wins() -> None:
    out, stream = _run([b"one two three"], stop=("three", "two"))
    assert "".join(out) == "one "
    assert stream.stop_string == "two"


def test_stop_inside_a_multibyte_piece() -> None:
    out, _ = _run(["你好".encode()[:4], "你好".encode()[4:] + "世界".encode()], stop=("好",))
    assert "".join(out) == "你"


def test_no_stop_streams_everything_at_once() -> None:
    stream = TextStream()
    assert stream.feed(b"abc") == "abc"


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        TextStream(["x", ""])
