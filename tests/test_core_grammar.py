"""agent.core.owner.grammar, constrained and tool_calls: grammar masks over a small byte-level
vocabulary, the draw rules of a constrained session, and tool calls in each model format."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agent.core.owner.constrained import draw_plan, masked_scores
from agent.core.owner.grammar import (
    GrammarError,
    GrammarTokenizer,
    TokenConstraint,
    close_objects,
    compile_json_schema,
    compile_lark,
)
from agent.core.owner.sampling import SamplingParams, sample_token
from agent.core.owner.session import Session
from agent.core.owner.tool_calls import (
    FORMATS,
    ParsedCall,
    call_schema,
    call_start,
    forced_call_lark,
    parse_tool_calls,
    tool_call_format,
)
from agent.core.wire.topk import TopLogits
from agent.core.wire.worker_records import TokenAttr, Vocabulary

pytestmark = pytest.mark.unit

EOS = 256  # a control token after the 256 byte tokens
WORDS = (b'{"', b'":', b"name", b"true", b"</tool_call>", b"<tool_call>")


def _vocabulary() -> Vocabulary:
    pieces = (*(bytes([b]) for b in range(256)), b"", *WORDS)
    attrs = tuple([int(TokenAttr.NORMAL)] * 256 + [int(TokenAttr.CONTROL)] + [int(TokenAttr.NORMAL)] * (len(WORDS) - 1))
    attrs += (int(TokenAttr.USER_DEFINED),)  # <tool_call>, as Qwen's vocabulary has it
    return Vocabulary(1, len(pieces), pieces, attrs, None, False, (EOS,))


@pytest.fixture(scope="module")
def tokenizer() -> GrammarTokenizer:
    return GrammarTokenizer(_vocabulary())


def _run(constraint: TokenConstraint, rng: np.random.Generator, limit: int = 400) -> bytes:
    """Draw uniformly among allowed tokens until the end-of-generation token."""
    pieces = _vocabulary().pieces
    out = b""
    for _ in range(limit):
        token = int(rng.choice(np.flatnonzero(constraint.allowed())))
        constraint.accept(token)
        if token == EOS:
            return out
        out += pieces[token]
    raise AssertionError(f"no end within {limit} tokens: {out!r}")


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "n"],
}


@pytest.mark.timeout(30)
def test_random_draws_under_a_schema_always_parse(tokenizer: GrammarTokenizer) -> None:
    grammar = compile_json_schema(SCHEMA, tokenizer)
    rng = np.random.default_rng(7)
    for _ in range(20):
        value = json.loads(_run(TokenConstraint(tokenizer, grammar), rng))
        assert set(value) == {"name", "ok", "n"}
        assert len(value["name"]) <= 6 and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99


@pytest.mark.timeout(30)
def test_a_schema_the_engine_cannot_compile_says_why(tokenizer: GrammarTokenizer) -> None:
    with pytest.raises(GrammarError, match="strin"):
        compile_json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}, tokenizer)
    with pytest.raises(GrammarError):
        compile_lark("start: undefined_rule", tokenizer)


def test_objects_listing_properties_are_closed_unless_they_say_otherwise() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {}}},
        "items": [{"properties": {}}],
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["items"][0]["additionalProperties"] is False
    assert close_objects({"properties": {}, "additionalProperties": True})["additionalProperties"] is True


@pytest.mark.timeout(30)
def test_the_mask_refuses_what_the_grammar_refuses_and_rollback_goes_back(tokenizer: GrammarTokenizer) -> None:
    constraint = TokenConstraint(tokenizer, compile_lark('start: "ab"', tokenizer))
    allowed = constraint.allowed()
    assert allowed[ord("a")] and not allowed[ord("b")] and not allowed[EOS]
    constraint.accept(ord("a"))
    assert constraint.allowed()[ord("b")]
    constraint.rollback(1)
    assert constraint.allowed()[ord("a")]
    constraint.accept(ord("a"))
    constraint.accept(ord("b"))
    assert constraint.accepting and constraint.allowed()[EOS]
    with pytest.raises(GrammarError):
        TokenConstraint(tokenizer, compile_lark('start: "ab"', tokenizer)).accept(ord("z"))


def test_constrained_sessions_draw_at_the_owner_from_full_rows() -> None:
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.7, top_k=40)
    plan = draw_plan(constrained=True, sampling=greedy, result_top_k=40)
    assert plan == draw_plan(constrained=True, sampling=sampled, result_top_k=40)
    assert plan.result_top_k == 0 and not plan.continuation and plan.at_owner
    assert draw_plan(constrained=False, sampling=greedy, result_top_k=40).continuation
    plain = draw_plan(constrained=False, sampling=sampled, result_top_k=40)
    assert not plain.continuation and not plain.at_owner  # a last hop may draw it
    assert draw_plan(constrained=False, sampling=SamplingParams(presence_penalty=0.5), result_top_k=0).at_owner


def test_masked_scores_of_a_row_and_of_a_top_k() -> None:
    row = np.array([3.0, 2.0, 1.0, 0.0], dtype=np.float32)
    allowed = np.array([False, True, False, True])
    masked = masked_scores(row, allowed)
    assert isinstance(masked, np.ndarray)
    assert sample_token(masked, SamplingParams(), None) == 1
    assert np.isneginf(masked[[0, 2]]).all()
    top = TopLogits.from_row(row, 2)
    kept = masked_scores(top, allowed)
    assert isinstance(kept, TopLogits) and kept.ids.tolist() == [1] and kept.log_sum_exp == top.log_sum_exp
    assert masked_scores(top, np.array([False, False, True, True])) is None  # a miss: the full row is needed
    with pytest.raises(ValueError, match="no token"):
        masked_scores(row, np.zeros(4, dtype=bool))


class _OnlyToken:
    """A grammar that allows one token, then the end token."""

    def __init__(self, token: int, end: int) -> None:
        self.tokens = [token, end]
        self.accepted: list[int] = []

    def allowed(self) -> np.ndarray:
        mask = np.zeros(8, dtype=bool)
        mask[self.tokens[len(self.accepted)]] = True
        return mask

    def accept(self, token: int) -> None:
        self.accepted.append(token)

    def rollback(self, tokens: int) -> None:
        del self.accepted[-tokens:]


def test_a_session_under_a_constraint_asks_for_full_rows_and_draws_the_allowed_token() -> None:
    constraint = _OnlyToken(5, 7)
    session = Session(bytes(16), [1, 2], max_new_tokens=4, stop_tokens=[7], constraint=constraint)
    assert session.result_top_k == 0 and not session.draw.continuation
    row = np.arange(8, dtype=np.float32)[::-1].copy()  # the model prefers token 0
    for expected in (5, 7):
        step = session.next_step()
        assert session.receive_scores(step.step, lambda: row, 8) == expected
    assert session.stopped_by_token and constraint.accepted == [5, 7]
    assert session.last_logits is row  # logprobs stay the model's


def test_tool_call_format_of_known_templates() -> None:
    assert tool_call_format("{{- '<tool_call>\\n' }}") == "hermes"
    assert tool_call_format("[TOOL_CALLS] {{ tools }}") == "mistral"
    assert tool_call_format("'[TOOL_CALLS]' + name + '[ARGS]'") == "mistral_args"
    assert tool_call_format("<|python_tag|>{{ x }}") == "llama3"
    assert tool_call_format("{{ tools | tojson }}") == "generic"


TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "ping"}},
]  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_calls_parse_back_in_every_format(tokenizer: GrammarTokenizer, fmt: str, parallel: bool) -> None:
    grammar = compile_lark(forced_call_lark(call_schema(TOOLS, fmt), fmt, parallel=parallel), tokenizer)
    rng = np.random.default_rng(3)
    for _ in range(5):
        text = _run(TokenConstraint(tokenizer, grammar), rng).decode()
        content, calls = parse_tool_calls(text, fmt, ["add", "ping"])
        assert calls and content is None, text
        for call in calls:
            arguments = json.loads(call.arguments)
            assert call.name in ("add", "ping")
            assert set(arguments) == ({"a", "b"} if call.name == "add" else set())


def allowed_ids(mask: np.ndarray) -> list[int]:
    return [int(t) for t in np.flatnonzero(mask)]


def test_a_user_defined_marker_token_may_start_a_forced_call(tokenizer: GrammarTokenizer) -> None:
    grammar = compile_lark(forced_call_lark(call_schema(TOOLS, "hermes"), "hermes", parallel=False), tokenizer)
    allowed = TokenConstraint(tokenizer, grammar).allowed()
    marker = 257 + WORDS.index(b"<tool_call>")
    # forced text is written as the longest tokens write it: the marker is one token
    assert allowed_ids(allowed) == [marker]


def test_a_named_function_narrows_the_schema() -> None:
    schema = call_schema(TOOLS, "hermes", "ping")
    assert schema["properties"]["name"] == {"const": "ping"}
    with pytest.raises(ValueError, match="nope"):
        call_schema(TOOLS, "hermes", "nope")


@pytest.mark.parametrize(
    ("text", "fmt", "content", "calls"),
    [
        ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "hermes", "Sure.",
         [ParsedCall("add", '{"a": 1, "b": 2}')]),
        ('<tool_call>{"name": "ping", "arguments": {}}</tool_call>\n<tool_call>{"name": "add", "arguments": '
         '"{\\"a\\": 1}"}</tool_call>', "hermes", None, [ParsedCall("ping", "{}"), ParsedCall("add", '{"a": 1}')]),
        ('<|python_tag|>{"name": "add", "parameters": {"a": 1}}', "llama3", None, [ParsedCall("add", '{"a": 1}')]),
        ('[TOOL_CALLS] [{"name": "ping", "arguments": {}}]', "mistral", None, [ParsedCall("ping", "{}")]),
        ('{"tool_calls": [{"name": "ping", "arguments": {}}]}', "generic", None, [ParsedCall("ping", "{}")]),
        ('ok [TOOL_CALLS]add[CALL_ID]x1[ARGS]{"a": 1}[TOOL_CALLS]ping[ARGS]{}', "mistral_args", "ok",
         [ParsedCall("add", '{"a": 1}'), ParsedCall("ping", "{}")]),
        ("[TOOL_CALLS]add[ARGS]{", "mistral_args", None, []),
        ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "hermes", None, []),
        ('<tool_call>{"name": "add", "arguments": {"a": 1', "hermes", None, []),
        ("Paris is the capital.", "generic", None, []),
        ('{"answer": 4}', "generic", None, []),
    ],
)  # fmt: skip
def test_parse_tool_calls(text: str, fmt: str, content: str | None, calls: list[ParsedCall]) -> None:
    parsed_content, parsed = parse_tool_calls(text, fmt, ["add", "ping"])
    assert parsed == calls
    assert parsed_content == (content if calls else text)


def test_call_start_holds_back_only_what_may_become_a_call() -> None:
    assert call_start("Hello <tool", "hermes") == 6
    assert call_start("Hello <tool_call>{", "hermes") == 6
    assert call_start("Hello world", "hermes") is None
    assert call_start("  {", "generic") == 0
    assert call_start("Paris", "llama3") is None
    assert call_start("<|python", "llama3") == 0


def test_qwen25_template_shows_tools_and_a_tool_history_as_transformers_would() -> None:
    from agent.core.owner.chat_template import ChatTemplate
    from agent.core.relay.structured import template_messages
    from agent.testing.synthetic import TEMPLATES_DIR

    source = (TEMPLATES_DIR / "qwen2.5-instruct.jinja").read_text()
    template = ChatTemplate(source)
    assert template.takes_tools and tool_call_format(source) == "hermes"
    assert not ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}").takes_tools
    history = [
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]  # fmt: skip
    text = template.render(template_messages(history), tools=TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n3\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", FORMATS)
def test_references_in_parameters_still_resolve_inside_a_call(tokenizer: GrammarTokenizer, fmt: str) -> None:
    import jsonschema

    nested = {
        "$defs": {"Inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
        "type": "object",
        "properties": {"inner": {"$ref": "#/$defs/Inner"}},
        "required": ["inner"],
    }
    tools = [{"type": "function", "function": {"name": n, "parameters": nested}} for n in ("one", "two")]
    grammar = compile_lark(forced_call_lark(call_schema(tools, fmt), fmt, parallel=False), tokenizer)
    text = _run(TokenConstraint(tokenizer, grammar), np.random.default_rng(5)).decode()
    (call,) = parse_tool_calls(text, fmt, ["one", "two"])[1]
    jsonschema.validate(json.loads(call.arguments), nested)


@pytest.mark.parametrize("seed", range(20))
def test_a_constrained_draw_equals_a_draw_from_the_masked_scores(seed: int) -> None:
    from agent.core.owner.constrained import constrained_draw
    from agent.core.owner.sampling import draw_token

    rng = np.random.default_rng(seed)
    row = rng.normal(size=64).astype(np.float32)
    row[rng.integers(0, 64, size=8)] = row.max()  # ties at the top
    allowed = rng.random(64) < 0.3
    allowed[int(rng.integers(0, 64))] = True
    masked = masked_scores(row, allowed)
    assert isinstance(masked, np.ndarray)
    assert constrained_draw(row, allowed, SamplingParams(), 0.0) == sample_token(masked, SamplingParams(), None)
    params = SamplingParams(temperature=0.8, top_k=5)
    drawn = constrained_draw(row, allowed, params, float(rng.random()))
    assert drawn is not None and allowed[drawn]
    uniform = float(np.random.default_rng(seed + 100).random())
    assert constrained_draw(row, allowed, params, uniform) == draw_token(masked, params, uniform)
    top = TopLogits.from_row(row, 4)
    if not allowed[top.ids].any():
        assert constrained_draw(top, allowed, SamplingParams(), 0.0) is None
