"""Unit tests of layer ranges (agent.core.wire.ranges): cuts, the B:E syntax, validation."""

from __future__ import annotations

import pytest

from agent.core.wire.ranges import LayerRange, check_cover, format_layers, parse_cuts, parse_layers, ranges_from_cuts

pytestmark = pytest.mark.unit


def test_ranges_from_cuts_smollm2_three_ways() -> None:
    assert ranges_from_cuts(30, [10, 20]) == [LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30)]


def test_ranges_from_cuts_gemma3_not_multiple_of_window_pattern() -> None:
    ranges = ranges_from_cuts(18, (4, 11))
    assert [r.as_list() for r in ranges] == [[0, 4], [4, 11], [11, 18]]
    assert [r.n_layers for r in ranges] == [4, 7, 7]


def test_no_cuts_is_the_whole_model() -> None:
    assert ranges_from_cuts(6, []) == [LayerRange(0, 6)]


def test_cut_at_every_layer() -> None:
    ranges = ranges_from_cuts(4, [1, 2, 3])
    assert [str(r) for r in ranges] == ["0:1", "1:2", "2:3", "3:4"]
    check_cover(4, ranges)


@pytest.mark.parametrize(
    ("cuts", "message"),
    [
        ([0], r"cut 0 is out of bounds: cuts must satisfy 0 < cut < n_layer = 30"),
        ([30], r"cut 30 is out of bounds"),
        ([31], r"cut 31 is out of bounds"),
        ([-1], r"cut -1 is out of bounds"),
        ([10, 10], r"cut 10 appears twice"),
        ([20, 10], r"cuts must be sorted ascending: 10 comes after 20"),
        ([10, 5, 20], r"cuts must be sorted ascending: 5 comes after 10"),
        ([10.0], r"cut #0 must be an int, got 10.0"),
        ([True], r"cut #0 must be an int, got True"),
    ],
)
def test_bad_cuts(cuts: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ranges_from_cuts(30, cuts)


@pytest.mark.parametrize("n_layer", [0, -3, 2.5, None])
def test_bad_n_layer(n_layer: object) -> None:
    with pytest.raises(ValueError, match="n_layer must be a positive int"):
        ranges_from_cuts(n_layer, [])  # type: ignore[arg-type]


def test_layer_range_validation_and_properties() -> None:
    r = LayerRange(10, 20)
    assert r.n_layers == 10
    assert not r.takes_tokens
    assert r.gives_logits(20) and not r.gives_logits(30)
    assert LayerRange(0, 3).takes_tokens
    assert str(r) == "10:20"
    assert LayerRange(0, 3) < LayerRange(3, 6)
    with pytest.raises(ValueError, match=r"\[5, 5\) is empty"):
        LayerRange(5, 5)
    with pytest.raises(ValueError, match=r"begin -1 is negative"):
        LayerRange(-1, 3)
    with pytest.raises(ValueError, match=r"LayerRange.end must be an int"):
        LayerRange(0, "3")  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        r.begin = 3  # type: ignore[misc]


def test_parse_layers() -> None:
    assert parse_layers("10:20") == (10, 20)
    assert parse_layers(" 0 : 5 ") == (0, 5)
    assert parse_layers("20:") == (20, None)
    assert parse_layers("20:-1") == (20, None)
    assert parse_layers("20:", n_layer=30) == (20, 30)
    assert parse_layers("20:-1", n_layer=30) == (20, 30)
    assert parse_layers("0:30", n_layer=30) == (0, 30)
    assert LayerRange(*parse_layers("4:", 18)) == LayerRange(4, 18)


@pytest.mark.parametrize(
    ("text", "n_layer", "message"),
    [
        ("10", None, r"must look like BEGIN:END"),
        ("1:2:3", None, r"must look like BEGIN:END"),
        ("a:5", None, r"begin 'a' is not an integer"),
        (":5", None, r"begin '' is not an integer"),
        ("-2:5", None, r"begin -2 is negative"),
        ("0:x", None, r"end 'x' is not an integer"),
        ("0:-2", None, r"end -2 is negative \(only -1 means 'to the end'\)"),
        ("5:5", None, r"end 5 must be greater than begin 5"),
        ("6:3", None, r"end 3 must be greater than begin 6"),
        ("30:", 30, r"begin 30 is past the last block \(n_layer = 30\)"),
        ("0:31", 30, r"end 31 is past n_layer = 30"),
    ],
)
def test_parse_layers_errors(text: str, n_layer: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_layers(text, n_layer)


def test_format_layers_round_trips() -> None:
    assert format_layers(10, 20) == "10:20"
    assert format_layers(20, None) == "20:"
    for begin, end in [(0, 5), (3, None)]:
        assert parse_layers(format_layers(begin, end)) == (begin, end)


def test_parse_cuts() -> None:
    assert parse_cuts("10,20") == [10, 20]
    assert parse_cuts(" 4 , 11 ") == [4, 11]
    assert parse_cuts("") == []
    with pytest.raises(ValueError, match=r"cut 'x' in '10,x' is not an integer"):
        parse_cuts("10,x")
    with pytest.raises(ValueError, match=r"cut '' in '10,' is not an integer"):
        parse_cuts("10,")


def test_check_cover() -> None:
    check_cover(30, ranges_from_cuts(30, [10, 20]))
    with pytest.raises(ValueError, match=r"range 11:20 does not start where the previous one ended \(10\)"):
        check_cover(30, [LayerRange(0, 10), LayerRange(11, 20), LayerRange(20, 30)])
    with pytest.raises(ValueError, match=r"ranges end at 20, not at n_layer = 30"):
        check_cover(30, [LayerRange(0, 20)])
