"""What every tool-call format shares: the `ToolCallFormat` protocol and the helpers the family parsers build on."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from relax_gym.tools.parser import MalformedToolCall, ParsedTurn, ToolCall, call_from_fields, decode_json, shown

Calls = Sequence[tuple[str, dict[str, Any]]]


@runtime_checkable
class ToolCallFormat(Protocol):
    """How one model family writes tool calls."""

    @property
    def name(self) -> str:
        """The family's name (read-only: the formats are frozen dataclasses)."""
        ...

    def parse(self, text: str) -> ParsedTurn:
        """The turn's content, reasoning, calls and errors; never raises on any str."""
        ...

    def write_calls(self, calls: Calls, content: str = "") -> str:
        """The text a model of this family generates for `calls` after the prose `content`."""
        ...


def to_json(value: Any) -> str:
    """`value` as JSON the way the models write it: non-ASCII text kept as is."""
    return json.dumps(value, ensure_ascii=False)


def make_turn(content: str, calls_and_errors: Sequence[ToolCall | MalformedToolCall], reasoning: str) -> ParsedTurn:
    """A turn from its prose and its calls and errors in the order read (the content stripped)."""
    calls = [c for c in calls_and_errors if isinstance(c, ToolCall)]
    errors = [c for c in calls_and_errors if isinstance(c, MalformedToolCall)]
    return ParsedTurn(content=content.strip(), calls=calls, errors=errors, reasoning=reasoning)


def call_with_json_args(raw: str, name: str, body: str, call_id: str | None = None) -> ToolCall | MalformedToolCall:
    """A call whose arguments are the JSON object `body` (blank is `{}`)."""
    if not body.strip():
        return call_from_fields(raw, name, {}, call_id)
    args, problem = decode_json(body)
    if problem is not None:
        return MalformedToolCall(raw, f"malformed JSON in the arguments of {shown(name.strip())}: {problem}")
    return call_from_fields(raw, name, args, call_id)
