"""Parsing `<tool_call>{json}</tool_call>` blocks (the Qwen / Hermes format), and what every format shares.

Model output is untrusted text: every malformed block becomes a `MalformedToolCall`
the model can read in its next observation; nothing here raises. The other
model families' formats live in `relax_gym.tools.formats` and build on the
helpers here (`split_reasoning`, `call_from_object`, `decode_json`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str
    #: the call's id when the model wrote one (Mistral v3 calls carry a 9-character id)
    id: str | None = None

    def to_message_dict(self) -> dict[str, Any]:
        """The `tool_calls` entry HF chat templates render for an assistant message."""
        entry: dict[str, Any] = {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if self.id is not None:
            entry["id"] = self.id
        return entry


@dataclass(frozen=True)
class MalformedToolCall:
    """A tool-call block the model wrote that could not be parsed (a record for the next observation, not an
    exception): the block as written and what is wrong with it."""

    raw: str
    message: str


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into its prose, its reasoning and its tool calls, in order of appearance.

    `content` is what an env grades: the prose or final answer, without the reasoning and
    without tool-call markup. `reasoning` is the model's thinking (a `<think>` block, the
    text before a lone `</think>`, harmony's analysis channel), kept apart so that an
    answer written only while thinking does not count.
    """

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[MalformedToolCall] = field(default_factory=list)
    reasoning: str = ""

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.calls or self.errors)


def shown(name: str, limit: int = 60) -> str:
    """`name` quoted for an error message, cut short: the model may write a name of any length."""
    return repr(name if len(name) <= limit else name[: limit - 3] + "...")


def json_problem(err: BaseException) -> str:
    """A short description of why `json.loads` failed, fit for the model to read."""
    if isinstance(err, json.JSONDecodeError):
        return err.msg
    if isinstance(err, RecursionError):
        return "nesting too deep"
    return str(err).split(":")[0][:120]  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"


def decode_json(body: str) -> tuple[Any, str | None]:
    """`(value, None)`, or `(None, problem)` when `body` is not JSON; never raises."""
    try:
        return json.loads(body), None
    except (ValueError, RecursionError) as err:  # ValueError: also a number past int's digit limit
        return None, json_problem(err)


def call_from_fields(raw: str, name: Any, args: Any, call_id: Any = None) -> ToolCall | MalformedToolCall:
    """Validates a call's name, arguments (an object, or a JSON string of one; None is {}) and id."""
    if not isinstance(name, str) or not name.strip():
        return MalformedToolCall(raw, 'a tool call needs a string "name"')
    name = name.strip()
    if isinstance(args, str):  # some models emit arguments as a JSON-encoded string
        if not args.strip():
            args = {}
        else:
            args, problem = decode_json(args)
            if problem is not None:
                return MalformedToolCall(raw,
                                         f'"arguments" of {shown(name)} is a string that is not valid JSON: {problem}')
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return MalformedToolCall(raw, f'"arguments" of {shown(name)} must be an object, got {type(args).__name__}')
    if call_id is not None and not isinstance(call_id, str):
        kind = type(call_id).__name__
        return MalformedToolCall(raw, f'the "id" of the call to {shown(name)} must be a string, got {kind}')
    return ToolCall(name=name, arguments=args, raw=raw, id=call_id)


def call_from_object(raw: str, obj: Any, *, with_id: bool = False) -> ToolCall | MalformedToolCall:
    """A call from a decoded `{"name": ..., "arguments" | "parameters": ...}` object."""
    if not isinstance(obj, dict):
        return MalformedToolCall(raw, f"a tool call must be a JSON object, got {type(obj).__name__}")
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    return call_from_fields(raw, obj.get("name"), args, obj.get("id") if with_id else None)


def _parse_block(raw: str) -> ToolCall | MalformedToolCall:
    obj, problem = decode_json(raw.strip())
    if problem is not None:
        return MalformedToolCall(raw, f"malformed JSON in tool call: {problem}")
    return call_from_object(raw, obj)


@dataclass(frozen=True)
class CodeBlock:
    """A closed Markdown code block: where it starts and ends in the text, its language tag and its body."""

    start: int
    end: int
    language: str
    body: str


def code_blocks(text: str) -> list[CodeBlock]:
    """The closed ``` blocks of `text` in order: each opens with ``` and a language tag on its own line and
    closes at the next ```. An unclosed last block is not one. Linear time: `str.find` only."""
    blocks: list[CodeBlock] = []
    pos = 0
    while (start := text.find("```", pos)) >= 0:
        line_end = text.find("\n", start + 3)
        close = text.find("```", line_end + 1) if line_end >= 0 else -1
        if close < 0:
            break
        blocks.append(CodeBlock(start, close + 3, text[start + 3 : line_end].strip(), text[line_end + 1 : close]))
        pos = close + 3
    return blocks


def split_reasoning(text: str, open_tag: str = THINK_OPEN, close_tag: str = THINK_CLOSE) -> tuple[str, str]:
    """`(reasoning, rest)`: the first `open_tag ... close_tag` block taken out of `text`.

    A `close_tag` with no `open_tag` before it ends reasoning the prompt opened (as
    DeepSeek-R1's and Qwen3's thinking templates do): everything before it is reasoning.
    An `open_tag` never closed means the generation stopped while thinking: everything
    after it is reasoning, and there is no answer. Text before the block stays in `rest`.
    Linear time: two `str.find`s.
    """
    end = text.find(close_tag)
    if end < 0:
        start = text.find(open_tag)
        if start < 0:
            return "", text
        return text[start + len(open_tag) :].strip(), text[:start]
    head, tail = text[:end], text[end + len(close_tag) :]
    start = head.find(open_tag)
    if start < 0:
        return head.strip(), tail
    return head[start + len(open_tag) :].strip(), head[:start] + tail


def parse_tool_calls(text: str) -> ParsedTurn:
    """The Hermes format: prose, reasoning and `<tool_call>` blocks; an unclosed trailing `<tool_call>` is an error.

    Calls are read outside the reasoning only: a `<tool_call>` written while thinking is not run.
    """
    reasoning, text = split_reasoning(text)
    calls: list[ToolCall] = []
    errors: list[MalformedToolCall] = []
    prose: list[str] = []
    pos = 0
    # str.find, not a lazy regex: `<tool_call>(.*?)</tool_call>` rescans the rest of the text from
    # every unclosed opening tag, quadratic time on a reply of many `<tool_call>`s.
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            break
        prose.append(text[pos:start])
        parsed = _parse_block(text[start + len(OPEN) : end])
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)  # type: ignore[arg-type]
        pos = end + len(CLOSE)
    tail = text[pos:]
    if OPEN in tail:
        cut = tail.index(OPEN)
        errors.append(MalformedToolCall(tail[cut:], f"unclosed {OPEN}: the call must end with {CLOSE}"))
        tail = tail[:cut]
    prose.append(tail)
    return ParsedTurn(content="".join(prose).strip(), calls=calls, errors=errors, reasoning=reasoning)
