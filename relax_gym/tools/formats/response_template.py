"""Parsing with the tokenizer's own transformers response template, for models that ship one."""

from __future__ import annotations

import inspect
import json
from typing import Any

from relax_gym.tools.formats.hermes import HermesFormat
from relax_gym.tools.formats.shared import Calls, ToolCallFormat, make_turn, to_json
from relax_gym.tools.parser import MalformedToolCall, ParsedTurn, ToolCall, call_from_fields


def _first_line(err: BaseException, limit: int = 200) -> str:
    line = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {line}"[:limit]


_FEED_CHARS = 512


def _takes_prefix(tokenizer: Any) -> bool:
    """Whether `tokenizer.parse_response` takes `prefix=` (transformers with `response_template`)."""
    try:
        return "prefix" in inspect.signature(tokenizer.parse_response).parameters
    except (TypeError, ValueError, AttributeError):
        return False


def has_response_template(tokenizer: Any) -> bool:
    """Whether `tokenizer.parse_response` can parse with a template the tokenizer carries.

    `response_template` (transformers 5.x) is used by a `parse_response` that takes `prefix=`;
    the older `response_schema` only by the older `parse_response` without it (newer
    transformers drop a `response_schema` when loading a tokenizer, and never read it).
    """
    if not callable(getattr(tokenizer, "parse_response", None)):
        return False
    if getattr(tokenizer, "response_template", None) is not None:
        return True
    return getattr(tokenizer, "response_schema", None) is not None and not _takes_prefix(tokenizer)


class ResponseTemplateFormat:
    """Parses with the tokenizer's own transformers response template, as `tokenizer.parse_response` does.

    `prefix` is the prompt text before the generation, as `parse_response(prefix=...)` takes it
    (default "": the parser sees the generation alone; pass the generation prompt, e.g. one
    ending in an opened `<think>`, when the chat template writes part of the reply). Any
    exception from transformers becomes one `MalformedToolCall`. `write_calls` is the `writer`'s
    (the family `detect_family` finds).

    The text is fed to transformers' streaming `ResponseParser` in 512-character pieces, which
    is what `parse_response` does in one piece: in one piece its delimiter scans rescan the
    rest of the text for every region, superlinear time (25,000 characters of
    `<tool_call>{}</tool_call>` take seconds, 100,000 minutes); in pieces each scan stops at
    the buffer's end, and the time is linear.
    """

    name = "response_template"

    def __init__(self, tokenizer: Any, *, writer: ToolCallFormat | None = None, prefix: str = ""):
        if not has_response_template(tokenizer):
            raise ValueError("the tokenizer has no response_template its parse_response can use")
        self.tokenizer = tokenizer
        self.writer: ToolCallFormat = writer if writer is not None else HermesFormat()
        self.prefix = prefix
        #: as the writer's: whether every tool result must carry a `tool_call_id`
        self.call_ids = bool(getattr(self.writer, "call_ids", False))
        self._legacy = getattr(tokenizer, "response_template", None) is None  # a `response_schema`
        self._template: Any = None
        if not self._legacy:
            try:
                from transformers.utils.chat_parsing.response_templates import load_response_template
            except ImportError:  # a transformers without the streaming parser: parse_response it is
                return
            try:
                self._template = load_response_template(tokenizer.response_template)
            except ValueError as err:
                raise ValueError(f"the tokenizer's response_template is invalid: {err}") from err

    def __repr__(self) -> str:
        return f"ResponseTemplateFormat(writer={self.writer!r}, prefix={self.prefix!r})"

    def parse(self, text: str) -> ParsedTurn:
        try:
            return message_to_turn(self._parse_response(text))
        except Exception as err:  # transformers raises ValueError, KeyError, re errors...: all become errors
            error = MalformedToolCall(text, f"could not parse the reply: {_first_line(err)}")
            return ParsedTurn(content="", errors=[error])

    def _parse_response(self, text: str) -> Any:
        if self._legacy:  # transformers before `response_template`: parse_response(text) read `response_schema`
            return self.tokenizer.parse_response(text)
        if self._template is None:
            return self.tokenizer.parse_response(text, prefix=self.prefix)
        from transformers.utils.chat_parsing import ResponseParser

        parser = ResponseParser(self._template, prefix=self.prefix)
        for start in range(0, len(text), _FEED_CHARS):
            parser.feed(text[start : start + _FEED_CHARS])
        message, _ = parser.finalize()
        return message

    def write_calls(self, calls: Calls, content: str = "") -> str:
        return self.writer.write_calls(calls, content)


def message_to_turn(message: Any) -> ParsedTurn:
    """A parsed assistant message dict (`content`, `tool_calls`, `reasoning_content` / `thinking`) as a turn."""
    if not isinstance(message, dict):
        raise TypeError(f"parse_response gave a {type(message).__name__}, not a message dict")
    content = message.get("content")
    if not isinstance(content, str):
        content = "" if content is None else to_json(content)
    reasoning = next(
        (r for key in ("reasoning_content", "thinking", "reasoning") if isinstance(r := message.get(key), str)), ""
    )
    entries = message.get("tool_calls") or []
    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list):
        raise TypeError(f"tool_calls is a {type(entries).__name__}, not a list")
    found: list[ToolCall | MalformedToolCall] = []
    for entry in entries:
        raw = json.dumps(entry, ensure_ascii=False, default=str)
        fn = entry.get("function", entry) if isinstance(entry, dict) else entry
        if not isinstance(fn, dict):
            found.append(MalformedToolCall(raw, f"a tool call must be a JSON object, got {type(fn).__name__}"))
            continue
        args = fn["arguments"] if "arguments" in fn else fn.get("parameters")
        call_id = entry.get("id") if isinstance(entry, dict) else None
        found.append(call_from_fields(raw, fn.get("name"), args, call_id))
    return make_turn(content, found, reasoning.strip())

