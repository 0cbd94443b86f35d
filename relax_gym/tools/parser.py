"""Parsing `<tool_call>{json}</tool_call>` blocks (the Qwen / Hermes format).

Model output is untrusted text: every malformed block becomes a `ToolCallError`
the model can read in its next observation; nothing here raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str

    def to_message_dict(self) -> dict[str, Any]:
        """The `tool_calls` entry HF chat templates render for an assistant message."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallError:
    raw: str
    message: str


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into its prose and its tool calls, in order of appearance."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.calls or self.errors)


def _json_problem(err: Exception) -> str:
    if isinstance(err, json.JSONDecodeError):
        return err.msg
    if isinstance(err, RecursionError):
        return "nesting too deep"
    return str(err).split(":")[0]  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"


def _parse_block(raw: str) -> ToolCall | ToolCallError:
    body = raw.strip()
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as err:  # ValueError: also a number past int's digit limit
        return ToolCallError(raw, f"malformed JSON in tool call: {_json_problem(err)}")
    if not isinstance(obj, dict):
        return ToolCallError(raw, f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(raw, 'a tool call needs a string "name"')
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit arguments as a JSON-encoded string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as err:
            problem = _json_problem(err)
            return ToolCallError(raw, f'"arguments" of {name!r} is a string that is not valid JSON: {problem}')
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCallError(raw, f'"arguments" of {name!r} must be an object, got {type(args).__name__}')
    return ToolCall(name=name, arguments=args, raw=raw)


def parse_tool_calls(text: str) -> ParsedTurn:
    """Splits `text` into prose and tool calls; an unclosed trailing `<tool_call>` is an error."""
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
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
        errors.append(ToolCallError(tail[cut:], f"unclosed {OPEN}: the call must end with {CLOSE}"))
        tail = tail[:cut]
    prose.append(tail)
    return ParsedTurn(content="".join(prose).strip(), calls=calls, errors=errors)
