"""OpenAI's chat completions over any `Engine`: what `relax-gym serve` answers at /v1/chat/completions.

A request's messages are rendered by the served model's own chat template (tools included), generated with
exact token ids, and answered in OpenAI's shape: the reply's content, its tool calls parsed by the model
family's parser (`tool_calls`, arguments as a JSON string), `finish_reason` ("tool_calls", "stop",
"length"), token logprobs when asked, and usage. `n` samples go as `n` requests (the engine batches them);
`stream` answers the same completion as server-sent events (one chunk per choice, then `[DONE]`).
Images arrive as `image_url` parts holding data URLs (never fetched from a URL). What a template cannot take
(text that is not UTF-8, JSON nested deeper than `MAX_DEPTH`, an image for a text model) is the request's error
(`RequestError`, a 400 naming it), never the server's; the render runs off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Literal, cast

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from relax_gym.engines.base import Engine, GenerateOutput, GenerateRequest, RequestError, SamplingParams, check_fits
from relax_gym.messages import Message, image, message, text
from relax_gym.models import LoadedModel, processor_inputs
from relax_gym.tools import ToolCallFormat

#: samples one request may ask for
MAX_N = 64
#: max_tokens when a request gives none
DEFAULT_MAX_TOKENS = 512
#: the deepest JSON a message, a tool call's arguments or a tool schema may nest (templates render it recursively)
MAX_DEPTH = 32


def check_plain(value: Any, where: str) -> None:
    """`value` (JSON data) nests at most `MAX_DEPTH` deep and holds only UTF-8 text; else RequestError naming
    `where`. Iterative: a hostile depth is measured, not recursed into."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise RequestError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as err:
                raise RequestError(f"{where}: not valid UTF-8 text (a lone surrogate at position {err.start})") \
                    from None
        elif isinstance(item, dict):
            stack += [(k, depth) for k in item] + [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, depth + 1) for v in item]


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionIn(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI's other knobs (user, metadata, ...) change nothing here

    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    # numbers and flags are strict (`true` is not 1, `"5"` is not 5)
    temperature: StrictFloat = Field(1.0, ge=0)
    top_p: StrictFloat = Field(1.0, gt=0, le=1)
    max_tokens: StrictInt | None = Field(None, ge=1, le=2**31 - 1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=2**31 - 1)
    stop: str | list[str] | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    logprobs: StrictBool = False
    #: a 64-bit seed, `n` apart for the `n` samples (torch seeds a generator with any 64-bit integer)
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**63 - MAX_N)
    stream: StrictBool = False


def to_messages(body: ChatCompletionIn, decode_image: Any) -> list[Message]:
    """The request's messages as relax_gym messages (an assistant's tool calls with arguments as objects, as chat
    templates take them); `decode_image(data_url, where)` reads an `image_url` part."""
    out: list[Message] = []
    check_plain(body.tools, "tools")
    for i, msg in enumerate(body.messages):
        check_plain(msg.model_dump(exclude_none=True), f"messages[{i}]")
        parts: list[Any] = []
        if isinstance(msg.content, str):
            parts.append(text(msg.content))
        for j, part in enumerate(msg.content if isinstance(msg.content, list) else []):
            if part.get("type") == "text":
                parts.append(text(str(part.get("text", ""))))
            elif part.get("type") == "image_url":
                url = (part.get("image_url") or {}).get("url", "")
                parts.append(image(decode_image(url, f"messages[{i}].content[{j}]")))
            else:
                raise RequestError(f"messages[{i}].content[{j}]: part type {part.get('type')!r} is not taken "
                                   "(text, image_url)")
        extra: dict[str, Any] = {}
        if msg.name is not None:
            extra["name"] = msg.name
        if msg.tool_call_id is not None:
            extra["tool_call_id"] = msg.tool_call_id
        if msg.tool_calls:
            extra["tool_calls"] = [_call_in(c) for c in msg.tool_calls]
            check_plain(extra["tool_calls"], f"messages[{i}].tool_calls")  # the arguments, parsed
        role = "system" if msg.role == "developer" else msg.role
        out.append(message(role, *parts, **extra))
    return out


def _call_in(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # else the template renders the string as it is
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
    return {**call, "function": function}


def offered_tools(body: ChatCompletionIn) -> list[dict[str, Any]] | None:
    """The tools the template shows: none under `tool_choice: "none"`. "auto", "required" and a named function
    show them all; the model decides whether to call (nothing forces a call)."""
    return None if body.tool_choice == "none" else body.tools or None


def sampling_of(body: ChatCompletionIn) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(temperature=body.temperature, top_p=body.top_p, stop=stop,
                          max_new_tokens=body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS,
                          seed=body.seed)


def prompt_request(loaded: LoadedModel, messages: list[Message], body: ChatCompletionIn) -> GenerateRequest:
    """The generation request of a chat: the template's ids with media placeholders expanded, and the media."""
    inputs = processor_inputs(loaded, messages, tools=offered_tools(body))
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    images = [p["image"] for m in messages for p in m["content"] if p["type"] == "image"]
    return GenerateRequest(inputs["input_ids"][0].tolist(), sampling_of(body), images=images, mm_inputs=media or None)


def choice_of(loaded: LoadedModel, out: GenerateOutput, index: int, tool_format: ToolCallFormat,
              eos_ids: frozenset[int], with_logprobs: bool) -> dict[str, Any]:
    """One OpenAI choice from an engine output: content, parsed tool calls, finish reason, logprobs."""
    ids = list(out.output_ids)
    body = ids[:-1] if ids and ids[-1] in eos_ids else ids
    raw = loaded.decode(body, skip_special_tokens=False)
    turn = tool_format.parse(raw)
    calls = [{"id": call.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
             for call in turn.calls]
    visible = turn.content if calls else loaded.decode(body, skip_special_tokens=True)
    reply: dict[str, Any] = {"role": "assistant", "content": visible}
    if turn.reasoning:
        reply["reasoning_content"] = turn.reasoning
    if calls:
        reply["tool_calls"] = calls
    # a generation cut short (its token budget, or the server's request timeout: "abort") is OpenAI's "length"
    finish = "tool_calls" if calls else "length" if out.finish_reason in ("length", "abort") else "stop"
    choice: dict[str, Any] = {"index": index, "message": reply, "finish_reason": finish, "logprobs": None}
    if with_logprobs:
        choice["logprobs"] = {"content": [
            {"token": loaded.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(out.output_ids, out.logprobs, strict=True)]}
    return choice


async def chat_completion(engine: Engine, loaded: LoadedModel, body: ChatCompletionIn, *,
                          tool_format: ToolCallFormat, decode_image: Any, model_name: str, context: int | None = None,
                          timeout_s: float | None = None, adapter: str | None = None) -> dict[str, Any]:
    """The completion of `body` on `engine`, in OpenAI's shape (see the module docstring).

    `context`: the model's, which the prompt and `max_tokens` must fit: a chat whose text cannot fit is refused
    before it is rendered (`LoadedModel.max_token_chars`), the prompt is checked before any prefill, and a chat that
    gives no `max_tokens` gets what the context has left, up to the default. `timeout_s`: the engine's bound on each
    generation, which then ends with the tokens it has so far, finish reason "length" (the embedded engine's).
    `adapter`: the loaded LoRA adapter it runs on (None: the base)."""
    if context is not None:
        chars = text_chars(body)
        if chars > context * loaded.max_token_chars:
            raise RequestError(f"messages: {chars} characters cannot fit in the model's context of {context} tokens")
    messages = to_messages(body, decode_image)
    try:  # rendering and tokenizing a long chat takes seconds: not on the loop that serves everyone
        request = await asyncio.to_thread(prompt_request, loaded, messages, body)
    except (ValueError, TypeError, RecursionError, TemplateError) as err:  # what the template cannot take
        raise RequestError(f"messages: the chat template cannot render them: {type(err).__name__}: "
                           f"{str(err)[:300]}") from None
    if context is not None:
        request = _fitted(request, body, context)
    request.adapter = adapter
    requests = [request if body.n == 1 else replace(request, sampling=replace(
        request.sampling, seed=None if body.seed is None else body.seed + i)) for i in range(body.n)]
    generate = engine.generate if timeout_s is None else \
        functools.partial(cast(Any, engine).generate, timeout_s=timeout_s)  # the embedded engine's bound
    outputs = await asyncio.gather(*(generate(r) for r in requests))
    eos = loaded.stop_token_ids()
    choices = [choice_of(loaded, out, i, tool_format, eos, body.logprobs) for i, out in enumerate(outputs)]
    completion = sum(len(o.output_ids) for o in outputs)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model_name, "choices": choices,
        "usage": {"prompt_tokens": len(request.input_ids), "completion_tokens": completion,
                  "total_tokens": len(request.input_ids) + completion},
    }


def text_chars(body: ChatCompletionIn) -> int:
    """The characters of a chat that become text tokens: its messages' text, tool calls and names, and its tools."""
    return sum(_text_chars(m) for m in body.messages) + (len(json.dumps(body.tools)) if body.tools else 0)


def _text_chars(msg: ChatMessageIn) -> int:
    """The characters of a message that become text tokens (an image part's data URL becomes its image's tokens,
    which the context check after the render counts)."""
    parts = msg.content if isinstance(msg.content, list) else [{"type": "text", "text": msg.content or ""}]
    text_chars = sum(len(str(p.get("text", ""))) for p in parts if p.get("type") == "text")
    return text_chars + (len(json.dumps(msg.tool_calls)) if msg.tool_calls else 0) + len(msg.name or "")


def _fitted(request: GenerateRequest, body: ChatCompletionIn, context: int) -> GenerateRequest:
    """`request` within `context`: a prompt that fills it, or a `max_tokens` past it, is refused (as /generate
    refuses it); with no `max_tokens` given, the default is cut to what the context has left."""
    prompt, asked = len(request.input_ids), body.max_completion_tokens or body.max_tokens
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    check_fits(prompt, asked or 0, context, "messages", field)  # the prompt counts its template and tools
    if asked is None and request.sampling.max_new_tokens > context - prompt:
        return replace(request, sampling=replace(request.sampling, max_new_tokens=context - prompt))
    return request


def stream_events(completion: dict[str, Any]) -> Iterator[str]:
    """A finished completion as OpenAI's server-sent events: one content (and tool-call) chunk per choice, a
    final chunk with its finish reason, then `[DONE]`."""
    head = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
            "model": completion["model"]}
    for choice in completion["choices"]:
        delta = {k: v for k, v in choice["message"].items() if v is not None}
        if "tool_calls" in delta:
            delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(delta["tool_calls"])]
        first = {"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
        yield f"data: {json.dumps({**head, 'choices': [first]})}\n\n"
        last = {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
        yield f"data: {json.dumps({**head, 'choices': [last]})}\n\n"
    yield f"data: {json.dumps({**head, 'choices': [], 'usage': completion['usage']})}\n\n"
    yield "data: [DONE]\n\n"
