"""Tool-call formats per model family: round trips, real-looking generations, malformed calls, fuzzing,
linear time, detection from a tokenizer, transformers' response templates, and ToolEnv using them."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from relax_gym import ToolEnv, tool
from relax_gym.models import build_tokenizer
from relax_gym.tools import (
    TOOL_FORMATS,
    DeepSeekFormat,
    HarmonyFormat,
    HermesFormat,
    Llama3Format,
    MistralFormat,
    ParsedTurn,
    ResponseTemplateFormat,
    ToolCall,
    ToolCallFormat,
    get_tool_format,
    parse_tool_calls,
    tool_format_for,
)
from relax_gym.tools.formats import make_call_id

ALL_FORMATS: list[ToolCallFormat] = [
    *TOOL_FORMATS.values(),
    MistralFormat(style="v11"),
    DeepSeekFormat(style="v3.1"),
]
HERMES_STRICT = HermesFormat()
FORMAT_IDS = [f"{f.name}-{getattr(f, 'style', '')}" for f in ALL_FORMATS]

# --- round trips ----------------------------------------------------------------------------------

SAFE = st.characters(blacklist_characters="<>[]{}|｜`", blacklist_categories=("Cs",))
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(SAFE, max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(SAFE, max_size=6), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(SAFE, max_size=8), json_values, max_size=4)
calls_strategy = st.lists(st.tuples(names, arguments), max_size=4)
contents = st.text(SAFE, max_size=40).map(str.strip)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FORMAT_IDS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=calls_strategy, content=contents)
def test_write_then_parse_round_trips(fmt: ToolCallFormat, calls: list[tuple[str, dict[str, Any]]], content: str):
    text = fmt.write_calls(calls, content)
    turn = fmt.parse(text)
    assert not turn.errors, (text, turn.errors)
    assert [(c.name, c.arguments) for c in turn.calls] == calls, text
    assert turn.content == content and turn.reasoning == ""
    ids = [c.id for c in turn.calls]
    if fmt == MistralFormat(style="v3"):
        assert all(isinstance(i, str) and len(i) == 9 and i.isalnum() for i in ids)
    else:
        assert ids == [None] * len(calls)


def test_registry_names_and_unknown_names() -> None:
    assert set(TOOL_FORMATS) == {"hermes", "hermes-loose", "llama3", "mistral", "deepseek", "harmony"}
    for name, fmt in TOOL_FORMATS.items():
        assert get_tool_format(name) is fmt and fmt.name == name and isinstance(fmt, ToolCallFormat)
    with pytest.raises(KeyError, match="hermes, hermes-loose, llama3, mistral, deepseek, harmony"):
        get_tool_format("qwen")
    with pytest.raises(ValueError, match="style"):
        MistralFormat(style="v7")


def test_tool_call_message_dict_carries_its_id() -> None:
    assert ToolCall("f", {"a": 1}, "", id="abcDEF123").to_message_dict() == {
        "type": "function", "function": {"name": "f", "arguments": {"a": 1}}, "id": "abcDEF123",
    }
    assert "id" not in ToolCall("f", {}, "").to_message_dict()


# --- hermes -----------------------------------------------------------------------------------------


def test_hermes_reasoning_is_kept_apart_from_content() -> None:
    qwen3 = (
        "<think>\nThe user wants 2+3. I will call add.\n</think>\n\nLet me add.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    )
    turn = HermesFormat().parse(qwen3)
    assert turn.reasoning == "The user wants 2+3. I will call add."
    assert turn.content == "Let me add." and [c.arguments for c in turn.calls] == [{"a": 2, "b": 3}]
    # the generation prompt opened the block: a lone </think> ends the reasoning
    turn = parse_tool_calls("91 = 7 * 13, so no.\n</think>\n\nNo, 91 = 7 × 13.")
    assert (turn.reasoning, turn.content) == ("91 = 7 * 13, so no.", "No, 91 = 7 × 13.")
    # cut off while thinking: no answer, and a call written while thinking is not run
    turn = parse_tool_calls('<think>maybe \\boxed{4}? <tool_call>{"name": "add", "arguments": {}}</tool_call>')
    assert turn.content == "" and not turn.has_tool_calls and turn.reasoning.startswith("maybe \\boxed{4}?")


def test_hermes_loose_reads_the_untagged_calls_qwen25_coder_05b_writes() -> None:
    """What Qwen2.5-Coder-0.5B-Instruct wrote, sampled through relax_gym with its own template (docs/envs.md):
    a bare call object, and a ```json fence (with and without prose before it); the strict format reads both
    as prose, and the loose one reads only call-shaped JSON, never code or other JSON, as calls."""
    loose, strict = get_tool_format("hermes-loose"), HERMES_STRICT
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    fenced = ('```json\n{\n  "name": "calculate_total_cost",\n  "arguments": {\n    "lollipops": 10,\n'
              '    "candy_cost": 3.20\n  }\n}\n```')
    for text, content in ((bare, ""), (fenced, ""), (f"I will look it up.\n{fenced}", "I will look it up.")):
        assert not strict.parse(text).has_tool_calls
        turn = loose.parse(text)
        assert turn.content == content and len(turn.calls) == 1 and not turn.errors, text
    assert loose.parse(fenced).calls[0].arguments == {"lollipops": 10, "candy_cost": 3.2}
    listed = loose.parse('```\n[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"x": 1}}]\n```')
    assert [(c.name, c.arguments) for c in listed.calls] == [("a", {}), ("b", {"x": 1})]
    for prose in ("```python\nprint(6 * 7)\n```", '```json\n{"total": 12}\n```', '{"name": "Bob", "age": 3}',
                  'See {"name": "a", "arguments": {}} above.', "```json\n", "The total is 12."):
        assert loose.parse(prose) == strict.parse(prose), prose
    broken = loose.parse('{"name": "price", "arguments": {"item": milk}}')  # an attempt at a call: an error
    assert not broken.calls and "malformed JSON" in broken.errors[0].message
    tagged = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n{"name": "b", "arguments": {}}'
    assert [c.name for c in loose.parse(tagged).calls] == ["a"]  # tags, where written, are the only calls
    thinking = loose.parse('<think>{"name": "a", "arguments": {}}</think>The total is 12.')
    assert thinking.content == "The total is 12." and not thinking.has_tool_calls


# --- llama3 -----------------------------------------------------------------------------------------


def test_llama3_json_calls_prose_and_python_tag() -> None:
    fmt = Llama3Format()
    turn = fmt.parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert [(c.name, c.arguments) for c in turn.calls] == [("get_weather", {"city": "Oslo"})] and turn.content == ""
    turn = fmt.parse('<|python_tag|>{"name": "a", "arguments": {"x": 1}};{"name": "b", "parameters": {}}<|eom_id|>')
    assert [(c.name, c.arguments) for c in turn.calls] == [("a", {"x": 1}), ("b", {})] and not turn.errors
    turn = fmt.parse('Checking.<|python_tag|>{"name": "a", "parameters": {"x": 1}}')
    assert turn.content == "Checking." and len(turn.calls) == 1
    assert fmt.parse("The weather in Oslo is 3 °C.").content == "The weather in Oslo is 3 °C."
    plain = fmt.parse('{"name": "Bob", "age": 3}')  # JSON, but not a call: an answer
    assert plain.content == '{"name": "Bob", "age": 3}' and not plain.has_tool_calls
    assert fmt.parse("[1, 2, 3]").content == "[1, 2, 3]"
    listed = fmt.parse('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]')
    assert [c.name for c in listed.calls] == ["a", "b"]


def test_llama32_pythonic_calls() -> None:
    turn = Llama3Format().parse('[get_weather(city="San Francisco", days=3), get_time(tz=("UTC",), now=True)]')
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("get_weather", {"city": "San Francisco", "days": 3}),
        ("get_time", {"tz": ["UTC"], "now": True}),
    ]
    bad = Llama3Format().parse("[f(1), g(x=open('/etc/passwd')), h.i(x=1), k(x={1, 2})]")
    assert not bad.calls and [e.message.split(" ")[0] for e in bad.errors] == ["pass", "argument", "a", "argument"]


def test_llama3_malformed_calls_are_errors() -> None:
    fmt = Llama3Format()
    messages = [e.message for e in fmt.parse('{"name": "a", "parameters": {"x": 1}').errors]
    assert len(messages) == 1 and "malformed JSON" in messages[0]
    turn = fmt.parse('{"name": "a", "parameters": {}} then {"name": "b", "parameters": {}}')
    assert [c.name for c in turn.calls] == ["a"] and "';'" in turn.errors[0].message
    assert '"name"' in fmt.parse('{"name": 5, "parameters": {}}').errors[0].message
    assert "must be an object" in fmt.parse('{"name": "a", "parameters": [1]}').errors[0].message
    assert "write tool calls" in fmt.parse("<|python_tag|>import math; print(math.pi)").errors[0].message
    assert fmt.parse("<|python_tag|>").errors


# --- mistral ----------------------------------------------------------------------------------------


def test_mistral_v3_lists_with_ids_and_v11_calls() -> None:
    fmt = MistralFormat()
    v3 = fmt.parse(
        'I will look both up.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"},'
        ' {"name": "get_time", "arguments": {"tz": "CET"}, "id": "Zz9Yy8Xx7"}]'
    )
    assert v3.content == "I will look both up." and not v3.errors
    assert [(c.name, c.arguments, c.id) for c in v3.calls] == [
        ("get_weather", {"city": "Paris"}, "abcDEF123"),
        ("get_time", {"tz": "CET"}, "Zz9Yy8Xx7"),
    ]
    v11 = MistralFormat(style="v11").parse('[THINK]Paris, then Rome.[/THINK]Sure.[TOOL_CALLS]get_weather[ARGS]'
                                           '{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}')
    assert v11.reasoning == "Paris, then Rome." and v11.content == "Sure."
    assert [c.arguments["city"] for c in v11.calls] == ["Paris", "Rome"] and v11.calls[0].id is None
    decoded_away = fmt.parse('[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]mul{"a": 3}')  # [ARGS] skipped
    assert [(c.name, c.arguments) for c in decoded_away.calls] == [("add", {"a": 3.5, "b": 4}), ("mul", {"a": 3})]
    with_id = fmt.parse('[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}')
    assert [(c.name, c.id) for c in with_id.calls] == [("add", "a1b2c3d4e")]
    no_id = '[TOOL_CALLS] [{"name": "add", "arguments": {}}]\nextra words'
    trailing = fmt.parse(no_id)
    assert trailing.content == "extra words"
    # v3 templates need an id on every call: one written without gets a deterministic one, as vLLM gives one
    assert trailing.calls[0].id == make_call_id(0, "add", {}) and trailing.calls[0].id.isalnum()
    assert MistralFormat(style="v11").parse(no_id).calls[0].id is None


def test_mistral_malformed_calls_are_errors() -> None:
    fmt = MistralFormat()
    cases = {
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}': "malformed JSON",
        '[TOOL_CALLS] [{"arguments": {}}]': '"name"',
        '[TOOL_CALLS] [{"name": "add", "arguments": 3}]': "must be an object",
        '[TOOL_CALLS] [{"name": "add", "arguments": {}, "id": "short"}]': "9 letters or digits",
        '[TOOL_CALLS] ["add"]': "JSON object",
        "[TOOL_CALLS] []": "empty list",
        "[TOOL_CALLS]I think I should call add": "write NAME[ARGS]",
        '[TOOL_CALLS]two words[ARGS]{"a": 1}': "tool's name",
        "[TOOL_CALLS]add[ARGS]{oops": "malformed JSON in the arguments of 'add'",
        "[TOOL_CALLS]": "write NAME[ARGS]",
    }
    for text, expected in cases.items():
        turn = fmt.parse(text)
        assert not turn.calls and len(turn.errors) == 1 and expected in turn.errors[0].message, (text, turn)


# --- deepseek ---------------------------------------------------------------------------------------


def test_deepseek_r1_and_v31_calls() -> None:
    fmt = DeepSeekFormat()
    r1 = (
        "The user wants the weather.\n</think>\n\nLet me check."
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Oslo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
        '{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
    )
    turn = fmt.parse(r1)
    assert turn.reasoning == "The user wants the weather." and turn.content == "Let me check."
    expected = [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})]
    assert [(c.name, c.arguments) for c in turn.calls] == expected
    v31 = fmt.parse(
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}<｜tool▁call▁end｜>"
        "<｜tool▁call▁begin｜>now<｜tool▁sep｜><｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    assert [(c.name, c.arguments) for c in v31.calls] == [("get_weather", {"city": "Oslo"}), ("now", {})]
    assert fmt.parse("Thinking.</think>It is 3 °C.").content == "It is 3 °C."


def test_deepseek_malformed_calls_are_errors() -> None:
    fmt = DeepSeekFormat()
    begin, end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    cases = {
        f"{begin}get_weather{{}}{end}": "missing <｜tool▁sep｜>",
        f"{begin}get_weather{sep}{{oops{end}": "malformed JSON in the arguments of 'get_weather'",
        f"{begin}function{sep}get_weather\n```json\n{{}}{end}": "unclosed ```json",
        f"{begin}{sep}{{}}{end}": "name",
        f'{begin}get_weather{sep}{{"city": "Oslo"}}': "unclosed <｜tool▁call▁begin｜>",
        "<｜tool▁calls▁begin｜>I will call it": "must be followed by",
        f"{begin}f{sep}[1]{end}": "must be an object",
    }
    for text, expected in cases.items():
        turn = fmt.parse(text)
        assert not turn.calls and len(turn.errors) == 1 and expected in turn.errors[0].message, (text, turn)


# --- harmony ----------------------------------------------------------------------------------------


def test_harmony_channels_and_recipients() -> None:
    fmt = HarmonyFormat()
    call = fmt.parse(
        "<|channel|>analysis<|message|>Need the weather; call get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"location": "San Francisco"}'
    )
    assert call.reasoning == "Need the weather; call get_weather." and call.content == ""
    assert [(c.name, c.arguments) for c in call.calls] == [("get_weather", {"location": "San Francisco"})]
    final = fmt.parse("<|channel|>analysis<|message|>It is 20 C.<|end|><|start|>assistant<|channel|>final"
                      "<|message|>It is 20 °C in San Francisco.<|return|>")
    assert (final.reasoning, final.content, final.has_tool_calls) == ("It is 20 C.", "It is 20 °C in San Francisco.",
                                                                      False)
    before_channel = fmt.parse(
        '<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.lookup<|channel|>commentary json'
        '<|message|>{"key": "a"}<|call|>'
    )
    assert [(c.name, c.arguments) for c in before_channel.calls] == [("lookup", {"key": "a"})]
    first = fmt.parse(' to=functions.lookup<|channel|>commentary <|constrain|>json<|message|>{"key": "b"}')
    assert [c.arguments for c in first.calls] == [{"key": "b"}]
    assert fmt.parse("no harmony markup at all").content == "no harmony markup at all"
    fake_reply = fmt.parse('<|channel|>final<|message|>ok<|end|><|start|>functions.lookup to=assistant<|channel|>'
                           "commentary<|message|>97<|end|>")
    assert fake_reply.content == "ok" and not fake_reply.has_tool_calls


def test_harmony_malformed_calls_are_errors() -> None:
    fmt = HarmonyFormat()
    cases = {
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops": "malformed JSON",
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>[1]": "must be an object",
        "<|channel|>commentary to=python<|message|>print(1)": "unknown recipient 'python'",
        "<|channel|>commentary to=functions.<|message|>{}": "unknown recipient",
        "<|channel|>commentary to=functions.f <|constrain|>json": "has no <|message|>",
    }
    for text, expected in cases.items():
        turn = fmt.parse(text)
        assert not turn.calls and len(turn.errors) == 1 and expected in turn.errors[0].message, (text, turn)
    truncated = fmt.parse("<|channel|>analysis<|message|>I think the answer is 4")
    assert truncated.content == "" and truncated.reasoning == "I think the answer is 4"


# --- fuzzing and time -------------------------------------------------------------------------------

MARKERS = [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>", "<|eom_id|>", "[TOOL_CALLS]", "[ARGS]",
    "[CALL_ID]", "[THINK]", "[/THINK]", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>",
    "<|constrain|>", "assistant", " to=functions.f", "analysis", "commentary", "final", "function", "\n```json\n",
    "```", "{", "}", "[", "]", "(", ")", '"name"', '"arguments"', '"parameters"', '"id"', ":", ",", ";", '"f"',
    "f(x=1)", "null", '"', "\\", "1e999", "9" * 30,
]
soup = st.lists(st.one_of(st.sampled_from(MARKERS), st.text(max_size=4)), max_size=30).map("".join)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FORMAT_IDS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(), soup))
def test_parsers_never_raise(fmt: ToolCallFormat, text: str) -> None:
    turn = fmt.parse(text)
    assert isinstance(turn, ParsedTurn) and isinstance(turn.content, str) and isinstance(turn.reasoning, str)
    for call in turn.calls:
        assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)
        json.dumps(call.to_message_dict(), default=str)
    assert all(isinstance(e.message, str) and len(e.message) < 300 for e in turn.errors)


HOSTILE = [
    *[m * 40_000 for m in MARKERS if len(m) > 1],
    "<|channel|>commentary to=functions.f<|message|>" * 20_000,
    "[TOOL_CALLS]f[ARGS]" * 20_000,
    "[TOOL_CALLS]" + "[" * 50_000,
    '{"name": "f", "parameters": {}};' * 20_000,
    "[" + "f(x=1)," * 20_000 + "]",
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json" * 20_000,
    '{"name": "f", "parameters": ' + '{"a": ' * 100_000,
    # names of any length, cut short in the error messages
    "[TOOL_CALLS]" + "a" * 100_000 + "[ARGS]{oops",
    "<|channel|>commentary to=functions." + "a" * 100_000 + "<|message|>{oops",
    '<tool_call>{"name": "' + "a" * 100_000 + '", "arguments": 5}</tool_call>',
    '{"name": "' + "a" * 100_000 + '", "parameters": 5}',
    "<｜tool▁call▁begin｜>" + "a" * 100_000 + "<｜tool▁sep｜>{oops<｜tool▁call▁end｜>",
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FORMAT_IDS)
def test_parsers_take_linear_time_on_hostile_text(fmt: ToolCallFormat) -> None:
    """Each text is 0.1-1 MB: a parser that rescans the rest per marker would take minutes (past the timeout)."""
    for text in HOSTILE:
        turn = fmt.parse(text)
        assert all(len(e.message) < 300 for e in turn.errors), text[:60]


# --- choosing a format from a tokenizer -------------------------------------------------------------


def tiny_tokenizer(tokens: tuple[str, ...] = (), chat_template: str | None = None) -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "hello": 1}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")))
    tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    tok.chat_template = chat_template
    return tok


@pytest.mark.parametrize(
    ("tokens", "template", "expected"),
    [
        ((), None, HermesFormat()),
        (("[TOOL_CALLS]", "[INST]"), None, MistralFormat(style="v3")),
        (("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"), None, MistralFormat(style="v11")),
        (("<|begin_of_text|>", "<|eot_id|>"), None, Llama3Format()),
        (("<|python_tag|>",), None, Llama3Format()),
        (("<｜Assistant｜>", "<｜User｜>"), None, DeepSeekFormat(style="r1")),
        (("<｜tool▁calls▁begin｜>",), "{{'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + args}}",
         DeepSeekFormat(style="v3.1")),
        (("<｜tool▁calls▁begin｜>",), "{{'function<｜tool▁sep｜>' + name + '\\n```json\\n'}}",
         DeepSeekFormat(style="r1")),
        (("<|channel|>", "<|constrain|>", "<|message|>"), None, HarmonyFormat()),
        (("<|channel|>",), None, HermesFormat()),  # harmony needs both tokens
        (("<tool_call>", "</tool_call>"), None, HermesFormat()),
        # a Hermes fine-tune of Llama: `<tool_call>` beats the inherited `<|eot_id|>`
        (("<|eot_id|>", "<|python_tag|>", "<tool_call>"), None, HermesFormat()),
        (("<|eot_id|>",), "{{'<tool_call>' + call + '</tool_call>'}}", HermesFormat()),
        # an R1 distill of Qwen keeps Qwen's `<tool_call>` and gains DeepSeek's markers
        (("<｜Assistant｜>", "<tool_call>"), None, DeepSeekFormat()),
        ((), "{{'<|start|>assistant to=functions.' + name + '<|channel|>commentary json<|message|>'}}",
         HarmonyFormat()),
    ],
)
def test_family_detection(tokens: tuple[str, ...], template: str | None, expected: ToolCallFormat) -> None:
    assert tool_format_for(tiny_tokenizer(tokens, template)) == expected


def test_detection_on_the_project_tokenizer_and_odd_objects() -> None:
    assert tool_format_for(build_tokenizer()) == HermesFormat()
    assert tool_format_for(SimpleNamespace(chat_template="[TOOL_CALLS]")) == MistralFormat()
    assert tool_format_for(object()) == HermesFormat()


# --- transformers' response templates ---------------------------------------------------------------

HERMES_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"},
    },
}


@pytest.fixture(scope="module")
def templated() -> PreTrainedTokenizerFast:
    tok = build_tokenizer()
    tok.response_template = HERMES_TEMPLATE
    return tok


def test_response_template_is_used_when_present(templated: PreTrainedTokenizerFast) -> None:
    fmt = tool_format_for(templated)
    assert isinstance(fmt, ResponseTemplateFormat) and fmt.writer == HermesFormat()
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    turn = fmt.parse(f"<think>add them</think>Adding.\n{call}")
    assert (turn.reasoning, turn.content) == ("add them", "Adding.")
    assert [(c.name, c.arguments) for c in turn.calls] == [("add", {"a": 1})]
    calls = [("add", {"a": 1}), ("mul", {"b": [2, 3]})]
    assert [(c.name, c.arguments) for c in fmt.parse(fmt.write_calls(calls, "Both.")).calls] == calls
    assert fmt.parse("Just 4.<|im_end|>").content == "Just 4."
    opened = ResponseTemplateFormat(templated, prefix="<|im_start|>assistant\n<think>\n")
    assert (opened.parse("r</think>4").reasoning, opened.parse("r</think>4").content) == ("r", "4")


def test_response_template_failures_are_errors(templated: PreTrainedTokenizerFast) -> None:
    fmt = tool_format_for(templated)
    turn = fmt.parse('Adding.<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>')
    assert not turn.calls and len(turn.errors) == 1 and "could not parse the reply" in turn.errors[0].message
    assert "must be an object" in fmt.parse('<tool_call>{"name": "f", "arguments": [1]}</tool_call>').errors[0].message
    assert '"name"' in fmt.parse('<tool_call>{"arguments": {}}</tool_call>').errors[0].message

    class Exploding:
        response_template = None
        response_schema: ClassVar[dict[str, str]] = {"x-regex": "("}

        def parse_response(self, response: str) -> dict[str, Any]:  # transformers before `prefix=`
            raise RuntimeError("bad schema\nwith details")

    exploding = tool_format_for(Exploding())
    assert isinstance(exploding, ResponseTemplateFormat)
    assert exploding.parse("hi").errors[0].message == "could not parse the reply: RuntimeError: bad schema"
    broken = build_tokenizer()
    broken.response_template = {"fields": {}}
    with pytest.raises(ValueError, match="response_template is invalid"):
        tool_format_for(broken)
    legacy_only = build_tokenizer()  # this transformers never reads `response_schema`: the family it is
    legacy_only.response_schema = {"type": "object"}
    assert tool_format_for(legacy_only) == HermesFormat()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(max_size=80), soup))
def test_response_template_matches_parse_response_and_never_raises(templated: PreTrainedTokenizerFast,
                                                                   text: str) -> None:
    fmt = ResponseTemplateFormat(templated)
    turn = fmt.parse(text)
    try:
        expected = templated.parse_response(text, prefix="")
    except Exception:
        assert turn.errors and not turn.calls
        return
    assert (turn.content, turn.reasoning) == ((expected.get("content") or "").strip(),
                                              (expected.get("reasoning_content") or "").strip())
    assert len(turn.calls) + len(turn.errors) == len(expected.get("tool_calls") or [])


@pytest.mark.timeout(60)
def test_response_template_parsing_is_linear(templated: PreTrainedTokenizerFast) -> None:
    """transformers' parse_response takes 152 s on this (past the timeout); fed in pieces it is linear."""
    fmt = ResponseTemplateFormat(templated)
    turn = fmt.parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 4_000)
    assert len(turn.calls) == 4_000


# --- ToolEnv ----------------------------------------------------------------------------------------


class Lookup(ToolEnv):
    """Find a value with a tool."""

    max_turns = 3

    def new_task(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": "What is the value of a?", "key": "a"}

    @tool
    def value(self, key: str) -> int:
        """Looks a value up.

        Args:
            key: a single letter
        """
        return ord(key)

    def grade(self, task: dict[str, Any], answer: str) -> float:
        return float(answer.strip() == "97")


def test_tool_env_reads_the_format_it_is_given_and_passes_call_ids() -> None:
    env = Lookup(tool_format="mistral")
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step(
        'Looking it up.[TOOL_CALLS] [{"name": "value", "arguments": {"key": "a"}, "id": "abcDEF123"}]'
    )
    assert [(m["role"], m["name"], m["tool_call_id"], m["content"][0]["text"]) for m in obs] == [
        ("tool", "value", "abcDEF123", "97")
    ]
    assert (reward, terminated, info["tool_successes"]) == (0.0, False, 1)
    assert env.step("[THINK]It is 97.[/THINK]97")[1:3] == (1.0, True)

    env = Lookup()
    assert env.tool_format == HermesFormat()
    env.tool_format = tool_format_for(tiny_tokenizer(("<|channel|>", "<|constrain|>")))
    env.reset(seed=0)
    obs, *_ = env.step(HarmonyFormat().write_calls([("value", {"key": "a"})]))
    assert obs[0]["content"][0]["text"] == "97" and "tool_call_id" not in obs[0]
    # the answer written only while reasoning does not count
    assert env.step("<|channel|>analysis<|message|>97<|end|><|start|>assistant<|channel|>final<|message|>no")[1] == 0.0


def test_tool_env_gives_every_tool_message_an_id_when_the_format_needs_them() -> None:
    """Mistral v3 templates refuse a tool result without a 9-character id: parser errors and notes get one too."""
    action = '[TOOL_CALLS] [{"name": "value", "arguments": {"key": "a"}}, {"name": "value", "arguments": 3}]'
    env = Lookup(tool_format="mistral", max_tool_calls_per_turn=1)
    env.reset(seed=0)
    obs, *_ = env.step(action + '[TOOL_CALLS] [{"name": "value", "arguments": {"key": "a"}, "id": "abcDEF123"}]')
    assert [m["name"] for m in obs] == ["tool_call_parser", "value", "tool_call_limit"]
    ids = [m["tool_call_id"] for m in obs]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 3
    assert ids[1] == make_call_id(0, "value", {"key": "a"})  # the id the parsed call was given
    for fmt in ("hermes", MistralFormat(style="v11")):
        env = Lookup(tool_format=fmt)
        env.reset(seed=0)
        broken = "<tool_call>{oops</tool_call>[TOOL_CALLS]f[ARGS]{"
        obs, *_ = env.step(env.tool_format.write_calls([("value", {"key": "a"})]) + broken)
        assert obs and not any("tool_call_id" in m for m in obs)
