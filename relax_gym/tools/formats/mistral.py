"""Mistral tool calls: `[TOOL_CALLS] [{"name": ..., "arguments": ..., "id": "abcDEF123"}]` (v3) and
`[TOOL_CALLS]name[ARGS]{...}` repeated (v11+; `[ARGS]` may be decoded away).

Mistral v3 is the format with a true `call_ids`: its templates refuse a tool result without a
`tool_call_id`, so `ToolEnv` gives one (`make_call_id`) to every tool message it writes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any

from relax_gym.tools.formats.shared import Calls, make_turn, to_json
from relax_gym.tools.parser import (
    MalformedToolCall,
    ParsedTurn,
    ToolCall,
    call_from_fields,
    json_problem,
    shown,
    split_reasoning,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
THINK, THINK_END = "[THINK]", "[/THINK]"


def make_call_id(*parts: Any) -> str:
    """A deterministic 9-character alphanumeric id from `parts`, the shape Mistral's templates require."""
    return hashlib.sha256(json.dumps(parts, ensure_ascii=False, default=str).encode()).hexdigest()[:9]


def _mistral_call(raw: str, name: Any, args: Any, call_id: Any) -> ToolCall | MalformedToolCall:
    if call_id is not None and not (isinstance(call_id, str) and len(call_id) == 9 and call_id.isascii()
                                    and call_id.isalnum()):
        return MalformedToolCall(raw, f'a tool call "id" must be 9 letters or digits, got {shown(str(call_id))}')
    return call_from_fields(raw, name, args, call_id)


@dataclass(frozen=True)
class MistralFormat:
    """Mistral: prose, then `[TOOL_CALLS]` and either a JSON list of calls (v3, with ids) or `name[ARGS]{json}`.

    Both are read whatever the style; `style` ("v3" or "v11") picks what `write_calls` writes,
    and with "v3" a call written without an id gets a deterministic one (as vLLM gives one),
    since v3 templates require a 9-character id on every call and tool result. Text after a
    call's JSON is content, as is everything before the first `[TOOL_CALLS]`.
    Reasoning is a `[THINK]...[/THINK]` block (Magistral) or a `<think>` block.
    """

    name: str = "mistral"
    style: str = "v3"

    def __post_init__(self) -> None:
        if self.style not in ("v3", "v11"):
            raise ValueError(f"MistralFormat style must be 'v3' or 'v11', got {self.style!r}")

    @property
    def call_ids(self) -> bool:
        """Whether every tool result must carry a `tool_call_id` (v3 templates refuse one without)."""
        return self.style == "v3"

    def parse(self, text: str) -> ParsedTurn:
        if THINK in text or THINK_END in text:
            reasoning, text = split_reasoning(text, THINK, THINK_END)
        else:
            reasoning, text = split_reasoning(text)
        head, *segments = text.rstrip().removesuffix("</s>").split(TOOL_CALLS)
        prose = [head]
        found: list[ToolCall | MalformedToolCall] = []
        for seg in segments:
            prose.append(self._segment(seg, found))
        if self.style == "v3":  # v3 templates want an id on every call and tool result: give one where none was written
            found = [
                replace(c, id=make_call_id(i, c.name, c.arguments)) if isinstance(c, ToolCall) and not c.id else c
                for i, c in enumerate(found)
            ]
        return make_turn("".join(prose), found, reasoning)

    @staticmethod
    def _segment(seg: str, found: list[ToolCall | MalformedToolCall]) -> str:
        """Reads the calls of one `[TOOL_CALLS]` segment into `found`; returns its trailing prose."""
        body = seg.lstrip()
        if body.startswith(("[", "{")):  # v3: a JSON list of calls (or one call)
            try:
                obj, end = json.JSONDecoder().raw_decode(body)
            except (ValueError, RecursionError) as err:
                found.append(MalformedToolCall(seg, f"malformed JSON after {TOOL_CALLS}: {json_problem(err)}"))
                return ""
            for item in obj if isinstance(obj, list) else [obj]:
                raw = to_json(item)
                if not isinstance(item, dict):
                    problem = f"a tool call must be a JSON object, got {type(item).__name__}"
                    found.append(MalformedToolCall(raw, problem))
                    continue
                args = item["arguments"] if "arguments" in item else item.get("parameters")
                found.append(_mistral_call(raw, item.get("name"), args, item.get("id")))
            if isinstance(obj, list) and not obj:
                found.append(MalformedToolCall(seg, f"an empty list of tool calls after {TOOL_CALLS}"))
            return body[end:]
        # v11: name[ARGS]{json}, or name{json} when [ARGS] was decoded away; name[CALL_ID]id[ARGS]{json}
        cut = body.find(ARGS)
        if cut >= 0:
            head, args_text = body[:cut], body[cut + len(ARGS) :]
        else:
            brace = body.find("{")
            if brace < 0:
                hint = f"after {TOOL_CALLS} write NAME{ARGS}{{json arguments}} or a JSON list of calls"
                found.append(MalformedToolCall(seg, hint))
                return ""
            head, args_text = body[:brace], body[brace:]
        name, _, call_id = head.partition(CALL_ID)
        name = name.strip()
        if not name or any(ch.isspace() for ch in name):
            found.append(MalformedToolCall(seg, f"after {TOOL_CALLS} write the tool's name, then {ARGS} and its JSON"))
            return ""
        args_text = args_text.lstrip()
        try:
            args, end = json.JSONDecoder().raw_decode(args_text)
        except (ValueError, RecursionError) as err:
            problem = f"malformed JSON in the arguments of {shown(name)}: {json_problem(err)}"
            found.append(MalformedToolCall(seg, problem))
            return ""
        found.append(_mistral_call(seg, name, args, call_id.strip() if CALL_ID in head else None))
        return args_text[end:]

    def write_calls(self, calls: Calls, content: str = "") -> str:
        if not calls:
            return content
        if self.style == "v11":
            return content + "".join(f"{TOOL_CALLS}{n}{ARGS}{to_json(a)}" for n, a in calls)
        listed = [{"name": n, "arguments": a, "id": make_call_id(i, n, a)} for i, (n, a) in enumerate(calls)]
        return f"{content}{TOOL_CALLS} {to_json(listed)}"

