import json

from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from relax_gym.tools import Tool, ToolCall, ToolDefinitionError, ToolSet, parse_tool_calls, to_parts


def add(a: int, b: int = 1) -> int:
    """Adds two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def explode(x: str) -> str:
    """Always fails.

    Args:
        x: ignored
    """
    raise RuntimeError("boom")


def call(name: str, args) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_schema_comes_from_hints_and_docstring():
    schema = Tool(add).schema
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "add"
    assert fn["description"] == "Adds two integers."
    assert fn["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first addend"}
    assert fn["parameters"]["required"] == ["a"]


def test_undocumented_function_is_refused_with_a_reason():
    def bare(x: int) -> int:
        return x

    try:
        Tool(bare)
    except ToolDefinitionError as err:
        assert "docstring" in str(err)
    else:
        raise AssertionError("a function without a docstring became a tool")


def test_parser_finds_several_calls_and_keeps_prose():
    turn = parse_tool_calls("Let me add. " + call("add", {"a": 1}) + " and " + call("add", {"a": 2, "b": 3}))
    assert [c.arguments for c in turn.calls] == [{"a": 1}, {"a": 2, "b": 3}]
    assert turn.content == "Let me add.  and"
    assert not turn.errors


def test_arguments_as_json_string_are_accepted():
    raw = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 4}"}</tool_call>'
    (c,) = parse_tool_calls(raw).calls
    assert c.arguments == {"a": 4}


def test_malformed_calls_become_errors_not_exceptions():
    text = (
        "<tool_call>{not json}</tool_call>"
        '<tool_call>["a list"]</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": 5}</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>'
        "<tool_call>{\"name\": \"add\""
    )
    turn = parse_tool_calls(text)
    assert not turn.calls
    messages = [e.message for e in turn.errors]
    assert len(messages) == 6
    assert "malformed JSON" in messages[0]
    assert "JSON object" in messages[1]
    assert '"name"' in messages[2]
    assert "must be an object" in messages[3]
    assert "not valid JSON" in messages[4]
    assert "unclosed" in messages[5]


def test_toolset_reports_unknown_tools_bad_types_and_crashes():
    tools = ToolSet([add, explode])
    ok = tools.execute(ToolCall("add", {"a": "2", "b": 3}, ""))  # lax coercion of "2" like a JSON-schema client
    assert not ok.is_error and ok.content[0]["text"] == "5"
    unknown = tools.execute(ToolCall("ad", {"a": 1}, ""))
    assert unknown.is_error and "Did you mean 'add'" in unknown.content[0]["text"]
    bad_type = tools.execute(ToolCall("add", {"a": "two"}, ""))
    assert bad_type.is_error and "a:" in bad_type.content[0]["text"] and "integer" in bad_type.content[0]["text"]
    missing = tools.execute(ToolCall("add", {}, ""))
    assert missing.is_error and "a:" in missing.content[0]["text"]
    extra = tools.execute(ToolCall("add", {"a": 1, "c": 2}, ""))
    assert extra.is_error and "unknown argument" in extra.content[0]["text"]
    crash = tools.execute(ToolCall("explode", {"x": "y"}, ""))
    assert crash.is_error and "RuntimeError: boom" in crash.content[0]["text"]


def test_duplicate_tool_names_are_refused():
    try:
        ToolSet([add, add])
    except ToolDefinitionError as err:
        assert "add" in str(err)
    else:
        raise AssertionError("two tools with one name were accepted")


def test_return_values_become_parts():
    img = Image.new("RGB", (3, 3))
    assert to_parts(img)[0]["image"] is img
    assert to_parts({"x": 1}) == [{"type": "text", "text": '{"x": 1}'}]
    assert to_parts([img, img])[1]["type"] == "image"


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_parser_never_raises_on_arbitrary_text(text):
    turn = parse_tool_calls(text)
    assert isinstance(turn.content, str)


tag_soup = st.lists(
    st.one_of(st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", ",", '"add"',
                               "[", "]", "null", '"', "\\"]), st.text(max_size=5)),
    max_size=30,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(tag_soup)
def test_parser_and_toolset_survive_tag_soup(text):
    tools = ToolSet([add, explode])
    turn = parse_tool_calls(text)
    for c in turn.calls:
        result = tools.execute(c)
        assert result.content
    assert text.count("<tool_call>") >= len(turn.calls)
