"""Llama 3.x tool calls: the whole reply is `{"name": ..., "parameters": ...}` (`;` between calls).

Optionally after `<|python_tag|>`; Llama 3.2's pythonic `[f(x=1), g(y="a")]` is read too.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from relax_gym.tools.formats.shared import Calls, make_turn, to_json
from relax_gym.tools.parser import (
    MalformedToolCall,
    ParsedTurn,
    ToolCall,
    call_from_fields,
    call_from_object,
    decode_json,
    json_problem,
    shown,
    split_reasoning,
)

PYTHON_TAG = "<|python_tag|>"
_LLAMA_STOPS = ("<|eom_id|>", "<|eot_id|>")
_WS = re.compile(r"\s*")


def _json_sequence(body: str) -> list[tuple[str, Any] | MalformedToolCall]:
    """`obj; obj; ...` decoded left to right; the first undecodable rest is one error."""
    decoder = json.JSONDecoder()
    out: list[tuple[str, Any] | MalformedToolCall] = []
    pos = _WS.match(body).end()  # type: ignore[union-attr]
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError) as err:
            out.append(MalformedToolCall(body[pos:], f"malformed JSON in tool call: {json_problem(err)}"))
            break
        out.append((body[pos:end], obj))
        pos = _WS.match(body, end).end()  # type: ignore[union-attr]
        if pos < len(body):
            if body[pos] != ";":
                out.append(MalformedToolCall(body[pos:], "unexpected text after a tool call: separate calls with ';'"))
                break
            pos = _WS.match(body, pos + 1).end()  # type: ignore[union-attr]
    return out


def _looks_like_call(obj: Any) -> bool:
    return isinstance(obj, dict) and "name" in obj and ("parameters" in obj or "arguments" in obj)


def _plain_json(value: Any) -> Any:
    """A `literal_eval` value as JSON data (tuples become lists); ValueError for sets, bytes, complex."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple):
        return [_plain_json(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain_json(v) for k, v in value.items()}
    raise ValueError(type(value).__name__)


def _pythonic_calls(body: str) -> list[ToolCall | MalformedToolCall] | None:
    """Llama 3.2's `[f(x=1), g(y="a")]`; None when `body` is not a list of calls."""
    try:
        node = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None
    if not isinstance(node, ast.List) or not node.elts:
        return None
    calls = [e for e in node.elts if isinstance(e, ast.Call)]
    if len(calls) != len(node.elts):
        return None
    out: list[ToolCall | MalformedToolCall] = []
    for call in calls:
        try:
            raw = ast.unparse(call)
        except (ValueError, RecursionError):
            raw = body
        if not isinstance(call.func, ast.Name):
            out.append(MalformedToolCall(raw,
                                         "a pythonic tool call must name the tool plainly: [tool_name(arg=value)]"))
            continue
        name = call.func.id
        if call.args or any(kw.arg is None for kw in call.keywords):
            out.append(MalformedToolCall(raw, f"pass the arguments of {shown(name)} by keyword: tool_name(arg=value)"))
            continue
        args: dict[str, Any] = {}
        for kw in call.keywords:
            try:
                args[str(kw.arg)] = _plain_json(ast.literal_eval(kw.value))
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                problem = f"argument {shown(str(kw.arg))} of {shown(name)} must be a JSON-like literal"
                out.append(MalformedToolCall(raw, problem))
                break
        else:
            out.append(call_from_fields(raw, name, args))
    return out


def llama3_calls(body: str, *, strict: bool) -> list[ToolCall | MalformedToolCall] | None:
    """The calls in `body`; None (not strict) when it is prose, not an attempt at calls.

    Public because `hermes-loose` reads untagged Qwen calls with it.
    """
    body = body.strip()
    if body.startswith("["):
        listed, _ = decode_json(body)
        if isinstance(listed, list) and listed and all(_looks_like_call(o) for o in listed):
            return [call_from_object(to_json(o), o) for o in listed]
        pythonic = _pythonic_calls(body) if body.endswith("]") else None
        if pythonic is not None or not strict:
            return pythonic
    elif body.startswith("{"):
        items = _json_sequence(body)
        first = items[0]
        attempt = _looks_like_call(first[1]) if isinstance(first, tuple) else (
            '"name"' in body and ('"parameters"' in body or '"arguments"' in body)
        )
        if attempt or strict:
            return [it if isinstance(it, MalformedToolCall) else call_from_object(*it) for it in items]
        return None
    if not strict:
        return None
    return [MalformedToolCall(body, f'after {PYTHON_TAG} write tool calls as {{"name": ..., "parameters": {{...}}}}')]


@dataclass(frozen=True)
class Llama3Format:
    """Llama 3.x JSON tool calling: the whole reply is `{"name": ..., "parameters": {...}}`, `;` between calls.

    Prose may precede the calls only through `<|python_tag|>` (what follows the tag must be
    calls); a reply without the tag is calls only if the whole of it is call-shaped JSON (or
    Llama 3.2's pythonic `[f(x=1)]` list), else it is prose. JSON that tries to be a call
    (has "name" and "parameters"/"arguments") but is malformed is an error.
    """

    name: str = "llama3"

    def parse(self, text: str) -> ParsedTurn:
        reasoning, text = split_reasoning(text)
        text = text.rstrip()
        for stop in _LLAMA_STOPS:
            text = text.removesuffix(stop)
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            body = text[tag + len(PYTHON_TAG) :].replace(PYTHON_TAG, "")
            return make_turn(text[:tag], llama3_calls(body, strict=True) or [], reasoning)
        found = llama3_calls(text, strict=False)
        return make_turn("" if found is not None else text, found or [], reasoning)

    def write_calls(self, calls: Calls, content: str = "") -> str:
        body = "; ".join(to_json({"name": n, "parameters": a}) for n, a in calls)
        if not calls:
            return content
        return f"{content}{PYTHON_TAG}{body}" if content else body
