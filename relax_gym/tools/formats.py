"""Tool-call formats per model family, and choosing one from a tokenizer.

Each family writes its tool calls its own way; a `ToolCallFormat` reads one family's
generations (decoded with `skip_special_tokens=False`, without the final stop token)
into a `ParsedTurn`, and writes the text such a model generates for given calls.

    hermes    Qwen2.5 / Qwen3 / Hermes: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks;
              `hermes-loose` also reads those calls written without the tags (bare or in a ``` fence)
    llama3    Llama 3.1-3.3: the whole reply is `{"name": ..., "parameters": ...}` (`;` between calls),
              optionally after `<|python_tag|>`; Llama 3.2's pythonic `[f(x=1), g(y="a")]` is read too
    mistral   `[TOOL_CALLS] [{"name": ..., "arguments": ..., "id": "abcDEF123"}]` (v3) and
              `[TOOL_CALLS]name[ARGS]{...}` repeated (v11+; `[ARGS]` may be decoded away)
    deepseek  `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json ...` (R1 / V3)
              and `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (V3.1)
    harmony   gpt-oss: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}` messages

Reasoning is kept apart from content: a `<think>` block or the text before a lone `</think>`
(`split_reasoning`; Mistral also `[THINK]...[/THINK]`), harmony's analysis channel. Calls are
read from the content only.

A format may also have a true `call_ids` attribute (Mistral v3): its templates refuse a tool
result without a `tool_call_id`, so `ToolEnv` gives one to every tool message it writes.

Every parser is a total function of untrusted text: malformed calls become `MalformedToolCall`s
the model can read, never exceptions, and all scanning is `str.find` / `str.split` or regexes
without nested quantifiers, so the time is linear in the text.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import inspect
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from relax_gym.tools.parser import (
    CLOSE,
    OPEN,
    MalformedToolCall,
    ParsedTurn,
    ToolCall,
    call_from_fields,
    call_from_object,
    code_blocks,
    decode_json,
    json_problem,
    parse_tool_calls,
    shown,
    split_reasoning,
)

Calls = Sequence[tuple[str, dict[str, Any]]]
_WS = re.compile(r"\s*")


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


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _turn(content: str, calls_and_errors: Sequence[ToolCall | MalformedToolCall], reasoning: str) -> ParsedTurn:
    calls = [c for c in calls_and_errors if isinstance(c, ToolCall)]
    errors = [c for c in calls_and_errors if isinstance(c, MalformedToolCall)]
    return ParsedTurn(content=content.strip(), calls=calls, errors=errors, reasoning=reasoning)


def _json_args(raw: str, name: str, body: str, call_id: str | None = None) -> ToolCall | MalformedToolCall:
    """A call whose arguments are the JSON object `body` (blank is `{}`)."""
    if not body.strip():
        return call_from_fields(raw, name, {}, call_id)
    args, problem = decode_json(body)
    if problem is not None:
        return MalformedToolCall(raw, f"malformed JSON in the arguments of {shown(name.strip())}: {problem}")
    return call_from_fields(raw, name, args, call_id)


def _trailing_fence(content: str) -> tuple[str, str]:
    """`(prose, body)` when `content` ends in a ```json (or bare ```) block; else `("", content)`."""
    content = content.rstrip()
    blocks = code_blocks(content)
    last = blocks[-1] if blocks else None
    if last is None or last.end != len(content) or last.language not in ("", "json"):
        return "", content
    return content[: last.start], last.body


# --- hermes ------------------------------------------------------------------------


@dataclass(frozen=True)
class HermesFormat:
    """Qwen / Hermes: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` blocks after optional prose.

    `loose` (registered as "hermes-loose") also reads the calls small Qwen2.5 models write without
    the tags their template teaches, measured on Qwen2.5-Coder-0.5B-Instruct (docs/envs.md): when
    a reply has no `<tool_call>`, its content is calls if all of it is call-shaped JSON (an object
    with "name" and "arguments" or "parameters", a list of them, or objects joined by `;`; Llama 3's
    reader, so a pythonic `[f(x=1)]` list counts too), or if it ends in one ``` fence (```json or
    bare) whose whole body is that; the prose before the fence stays content. Anything else is
    prose, as in the strict format.
    """

    name: str = "hermes"
    loose: bool = False

    def parse(self, text: str) -> ParsedTurn:
        turn = parse_tool_calls(text)
        if not self.loose or turn.has_tool_calls:
            return turn
        prose, body = _trailing_fence(turn.content)
        found = Llama3Format._calls(body, strict=False)
        if found is None:
            return turn
        return _turn(prose, found, turn.reasoning)

    def write_calls(self, calls: Calls, content: str = "") -> str:
        blocks = [f"{OPEN}\n{_dumps({'name': n, 'arguments': a})}\n{CLOSE}" for n, a in calls]
        return "\n".join(([content] if content else []) + blocks)


# --- llama3 ------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
_LLAMA_STOPS = ("<|eom_id|>", "<|eot_id|>")


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
            return _turn(text[:tag], self._calls(body, strict=True) or [], reasoning)
        found = self._calls(text, strict=False)
        return _turn("" if found is not None else text, found or [], reasoning)

    @staticmethod
    def _calls(body: str, *, strict: bool) -> list[ToolCall | MalformedToolCall] | None:
        """The calls in `body`; None (not strict) when it is prose, not an attempt at calls."""
        body = body.strip()
        if body.startswith("["):
            listed, _ = decode_json(body)
            if isinstance(listed, list) and listed and all(_looks_like_call(o) for o in listed):
                return [call_from_object(_dumps(o), o) for o in listed]
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
        return [MalformedToolCall(body,
                                  f'after {PYTHON_TAG} write tool calls as {{"name": ..., "parameters": {{...}}}}')]

    def write_calls(self, calls: Calls, content: str = "") -> str:
        body = "; ".join(_dumps({"name": n, "parameters": a}) for n, a in calls)
        if not calls:
            return content
        return f"{content}{PYTHON_TAG}{body}" if content else body


# --- mistral -----------------------------------------------------------------------

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
        return _turn("".join(prose), found, reasoning)

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
                raw = _dumps(item)
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
            return content + "".join(f"{TOOL_CALLS}{n}{ARGS}{_dumps(a)}" for n, a in calls)
        listed = [{"name": n, "arguments": a, "id": make_call_id(i, n, a)} for i, (n, a) in enumerate(calls)]
        return f"{content}{TOOL_CALLS} {_dumps(listed)}"


# --- deepseek ----------------------------------------------------------------------

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_EOS = "<｜end▁of▁sentence｜>"


def _deepseek_call(raw: str) -> ToolCall | MalformedToolCall:
    sep = raw.find(DS_SEP)
    if sep < 0:
        return MalformedToolCall(raw, f"missing {DS_SEP} between the tool's name and its arguments")
    left, right = raw[:sep].strip(), raw[sep + len(DS_SEP) :]
    fence = right.find("```")
    if left == "function" and (fence >= 0 or "\n" in right.strip()):  # R1 / V3: function<sep>NAME\n```json\n{}\n```
        newline = right.find("\n")
        split = min(i for i in (fence, newline, len(right)) if i >= 0)
        name, args_text = right[:split].strip(), right[split:].strip()
        if args_text.startswith("```"):
            args_text = args_text[3:].removeprefix("json")
            close = args_text.rfind("```")
            if close < 0:
                return MalformedToolCall(raw, f"unclosed ```json block in the arguments of {shown(name)}")
            args_text = args_text[:close]
    else:  # V3.1: NAME<sep>{json}
        name, args_text = left, right
    if not name:
        return MalformedToolCall(raw, "a tool call needs the tool's name")
    return _json_args(raw, name, args_text)


@dataclass(frozen=True)
class DeepSeekFormat:
    """DeepSeek: calls between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`, in the R1 or the V3.1 shape.

    Both shapes are read whatever the style; `style` ("r1" or "v3.1") picks what `write_calls`
    writes. Reasoning is the text before `</think>` (the R1 prompt opens the block).
    """

    name: str = "deepseek"
    style: str = "r1"

    def __post_init__(self) -> None:
        if self.style not in ("r1", "v3.1"):
            raise ValueError(f"DeepSeekFormat style must be 'r1' or 'v3.1', got {self.style!r}")

    def parse(self, text: str) -> ParsedTurn:
        reasoning, text = split_reasoning(text)
        text = text.rstrip().removesuffix(DS_EOS)
        opened = DS_CALLS_BEGIN in text
        text = text.replace(DS_CALLS_BEGIN, "").replace(DS_CALLS_END, "")
        found: list[ToolCall | MalformedToolCall] = []
        prose: list[str] = []
        pos = 0
        while (start := text.find(DS_CALL_BEGIN, pos)) >= 0:  # str.find: linear, as in the hermes parser
            end = text.find(DS_CALL_END, start + len(DS_CALL_BEGIN))
            if end < 0:
                break
            prose.append(text[pos:start])
            found.append(_deepseek_call(text[start + len(DS_CALL_BEGIN) : end]))
            pos = end + len(DS_CALL_END)
        tail = text[pos:]
        if DS_CALL_BEGIN in tail:
            cut = tail.index(DS_CALL_BEGIN)
            problem = f"unclosed {DS_CALL_BEGIN}: the call must end with {DS_CALL_END}"
            found.append(MalformedToolCall(tail[cut:], problem))
            tail = tail[:cut]
        prose.append(tail)
        if opened and not found:
            found.append(MalformedToolCall(text, f"{DS_CALLS_BEGIN} must be followed by {DS_CALL_BEGIN}"))
        return _turn("".join(prose), found, reasoning)

    def write_calls(self, calls: Calls, content: str = "") -> str:
        if not calls:
            return content
        if self.style == "v3.1":
            body = "".join(f"{DS_CALL_BEGIN}{n}{DS_SEP}{_dumps(a)}{DS_CALL_END}" for n, a in calls)
        else:
            body = "\n".join(
                f"{DS_CALL_BEGIN}function{DS_SEP}{n}\n```json\n{_dumps(a)}\n```{DS_CALL_END}" for n, a in calls
            )
        return f"{content}{DS_CALLS_BEGIN}{body}{DS_CALLS_END}"


# --- harmony -----------------------------------------------------------------------

H_START, H_END, H_CALL, H_RETURN = "<|start|>", "<|end|>", "<|call|>", "<|return|>"
H_CHANNEL, H_MESSAGE, H_CONSTRAIN = "<|channel|>", "<|message|>", "<|constrain|>"
_H_SPLIT = re.compile(r"(<\|(?:start|end|call|return)\|>)")
_H_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_FUNCTIONS = "functions."


@dataclass(frozen=True)
class HarmonyFormat:
    """gpt-oss's harmony: messages `<|channel|>CHANNEL[ to=functions.NAME][ <|constrain|>json]<|message|>BODY`.

    The generation prompt ends at `<|start|>assistant`, so the text starts with the first
    message's header; messages are joined by `<|end|><|start|>assistant` (or `<|call|>...`).
    A message addressed `to=functions.NAME` (in its header, before or after `<|channel|>`)
    is a tool call with JSON arguments; `analysis` is reasoning; `final` and recipient-less
    `commentary` (a preamble) are content. Messages written for another role are dropped;
    text with no harmony markup at all is content.
    """

    name: str = "harmony"

    def parse(self, text: str) -> ParsedTurn:
        content: list[str] = []
        reasoning: list[str] = []
        found: list[ToolCall | MalformedToolCall] = []
        pieces = _H_SPLIT.split(text)  # chunk, delimiter, chunk, ...: the group keeps the delimiters
        for i in range(0, len(pieces), 2):
            chunk, opened = pieces[i], i > 0 and pieces[i - 1] == H_START
            cut = chunk.find(H_MESSAGE)
            header = chunk if cut < 0 else chunk[:cut]
            if cut < 0 and not opened and H_CHANNEL not in header:  # no header at all: bare text
                content.append(chunk)
                continue
            pre, _, post = header.partition(H_CHANNEL)
            found_recipient = _H_RECIPIENT.search(header)
            recipient = found_recipient.group(1) if found_recipient else None
            role = next((w for w in pre.split() if not w.startswith("to=")), None)
            if role not in (None, "assistant"):
                continue  # the model wrote another role's message (e.g. a tool's reply)
            if cut < 0:  # a header cut off before its message
                if recipient is not None:
                    problem = f"the call to {shown(recipient)} has no {H_MESSAGE} with its arguments"
                    found.append(MalformedToolCall(chunk, problem))
                continue
            body = chunk[cut + len(H_MESSAGE) :]
            channel = next((w for w in post.replace(H_CONSTRAIN, " ").split() if not w.startswith("to=")), None)
            if recipient is not None:
                if not recipient.startswith(_FUNCTIONS) or len(recipient) == len(_FUNCTIONS):
                    hint = f"unknown recipient {shown(recipient)}: address a tool call to=functions.TOOL_NAME"
                    found.append(MalformedToolCall(chunk, hint))
                else:
                    found.append(_json_args(chunk, recipient[len(_FUNCTIONS) :], body))
            elif channel == "analysis":
                reasoning.append(body.strip())
            else:
                content.append(body.strip())
        return _turn("\n".join(c for c in content if c.strip()), found, "\n".join(r for r in reasoning if r))

    def write_calls(self, calls: Calls, content: str = "") -> str:
        messages: list[tuple[str, str]] = []  # (message, the token that ends it)
        if content or not calls:
            channel = "commentary" if calls else "final"
            messages.append((f"{H_CHANNEL}{channel}{H_MESSAGE}{content}", H_END))
        for n, a in calls:
            header = f"{H_CHANNEL}commentary to={_FUNCTIONS}{n} {H_CONSTRAIN}json"
            messages.append((f"{header}{H_MESSAGE}{_dumps(a)}", H_CALL))
        return "".join(
            msg + (f"{stop}{H_START}assistant" if i < len(messages) - 1 else "")
            for i, (msg, stop) in enumerate(messages)
        )


# --- transformers' response templates ----------------------------------------------


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
        content = "" if content is None else _dumps(content)
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
    return _turn(content, found, reasoning.strip())


# --- the registry and choosing from a tokenizer ------------------------------------

HERMES = HermesFormat()
TOOL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": HERMES,
    "hermes-loose": HermesFormat(name="hermes-loose", loose=True),
    "llama3": Llama3Format(),
    "mistral": MistralFormat(),
    "deepseek": DeepSeekFormat(),
    "harmony": HarmonyFormat(),
}


def get_tool_format(name: str) -> ToolCallFormat:
    """The registered format called `name`; KeyError naming the known ones otherwise."""
    try:
        return TOOL_FORMATS[name]
    except (KeyError, TypeError):
        raise KeyError(f"unknown tool-call format {name!r}; known formats: {', '.join(TOOL_FORMATS)}") from None


# Detection, first match wins. The chat template is checked before the vocabulary, as it is how
# the model was taught to write calls (a Hermes fine-tune of Llama keeps `<|eot_id|>` in its
# vocabulary but renders `<tool_call>`); each is checked in this family order:
#   mistral   `[TOOL_CALLS]`
#   deepseek  `<｜tool▁calls▁begin｜>` (template: also `<｜tool▁call▁begin｜>`), vocabulary also `<｜Assistant｜>`;
#             before hermes and llama3, as R1 distills of Qwen and Llama keep those vocabularies
#   harmony   template `<|channel|>`; vocabulary `<|channel|>` and `<|constrain|>` both
#   hermes    `<tool_call>`; before llama3, whose `<|eot_id|>` every Llama fine-tune inherits
#   llama3    `<|python_tag|>`, vocabulary also `<|eot_id|>`
# and hermes, the project's default, when nothing matches. Each entry lists alternatives, each
# alternative the tokens that must all be present.
_TEMPLATE_MARKERS: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    ("mistral", ((TOOL_CALLS,),)),
    ("deepseek", ((DS_CALLS_BEGIN,), (DS_CALL_BEGIN,))),
    ("harmony", ((H_CHANNEL,),)),
    ("hermes", ((OPEN,),)),
    ("llama3", ((PYTHON_TAG,),)),
)
_VOCAB_MARKERS: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    ("mistral", ((TOOL_CALLS,),)),
    ("deepseek", ((DS_CALLS_BEGIN,), ("<｜Assistant｜>",))),
    ("harmony", ((H_CHANNEL, H_CONSTRAIN),)),
    ("hermes", ((OPEN,),)),
    ("llama3", ((PYTHON_TAG,), ("<|eot_id|>",))),
)


def _chat_template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def _vocabulary(tokenizer: Any) -> set[str]:
    tokens: set[str] = set()
    with contextlib.suppress(Exception):  # a tokenizer without a usable get_vocab: detect from the rest
        tokens.update(tokenizer.get_vocab())
    for attr in ("added_tokens_encoder", "all_special_tokens"):
        with contextlib.suppress(Exception):
            tokens.update(str(t) for t in getattr(tokenizer, attr, None) or ())
    return tokens


def _family(name: str, vocab: set[str], template: str) -> ToolCallFormat:
    if name == "mistral":
        return MistralFormat(style="v11" if ARGS in vocab or ARGS in template else "v3")
    if name == "deepseek":
        v31 = bool(template) and "```json" not in template and DS_SEP in template
        return DeepSeekFormat(style="v3.1" if v31 else "r1")
    return TOOL_FORMATS[name]


def detect_family(tokenizer: Any) -> ToolCallFormat:
    """The family format from the tokenizer's chat template, then its vocabulary; hermes if nothing matches."""
    template = _chat_template_text(tokenizer)
    vocab = _vocabulary(tokenizer)
    for where, table in ((template, _TEMPLATE_MARKERS), (vocab, _VOCAB_MARKERS)):
        for name, alternatives in table:
            if any(all(token in where for token in tokens) for tokens in alternatives):
                return _family(name, vocab, template)
    return HERMES


def tool_format_of(loaded: Any) -> ToolCallFormat:
    """How a `LoadedModel`'s tool calls are read: the format its options name, else the one its tokenizer implies."""
    if loaded.tool_format == "auto":
        return tool_format_for(loaded.tokenizer)
    return get_tool_format(loaded.tool_format)


def tool_format_for(tokenizer: Any) -> ToolCallFormat:
    """The format to read this tokenizer's model with.

    A tokenizer carrying a transformers response template its `parse_response` uses
    (`response_template`; with older transformers, `response_schema`; see
    `has_response_template`) is parsed by it (`ResponseTemplateFormat`, writing with the
    detected family); otherwise the family is detected from the chat template and the
    vocabulary (see `detect_family`).
    """
    family = detect_family(tokenizer)
    if has_response_template(tokenizer):
        return ResponseTemplateFormat(tokenizer, writer=family)
    return family
