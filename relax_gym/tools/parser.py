"""Parsing `<tool_call>{json}</tool_call>` blocks (the Qwen / Hermes format).

Model output is untrusted text: every malformed block becomes a `ToolCallError`
the model can read in its next observation; nothing here raises.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


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


def _parse_block(raw: str) -> ToolCall | ToolCallError:
    body = raw.strip()
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as err:
        msg = err.msg if isinstance(err, json.JSONDecodeError) else "nesting too deep"
        return ToolCallError(raw, f"malformed JSON in tool call: {msg}")
    if not isinstance(obj, dict):
        return ToolCallError(raw, f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(raw, 'a tool call needs a string "name"')
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit arguments as a JSON-encoded string
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return ToolCallError(raw, f'"arguments" of {name!r} is a string that is not valid JSON')
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
    for match in _BLOCK.finditer(text):
        prose.append(text[pos : match.start()])
        parsed = _parse_block(match.group(1))
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)  # type: ignore[arg-type]
        pos = match.end()
    tail = text[pos:]
    if OPEN in tail:
        cut = tail.index(OPEN)
        errors.append(ToolCallError(tail[cut:], f"unclosed {OPEN}: the call must end with {CLOSE}"))
        tail = tail[:cut]
    prose.append(tail)
    return ParsedTurn(content="".join(prose).strip(), calls=calls, errors=errors)
