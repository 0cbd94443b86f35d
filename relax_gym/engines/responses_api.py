"""OpenAI's Responses API (`POST /v1/responses`) as a translation of the chat completions `openai_api` answers.

Agents written against the Responses API (NeMo Gym agents, verifiers harnesses) then run unchanged on
`relax-gym serve` and train through the agent proxy: a request becomes the chat-completions request the chat
route takes (`to_chat`), and its completion becomes a Responses object (`from_chat`), so rendering, generation,
tool-call parsing and the proxy's exact token chains are the chat path's, unchanged.

Translated: `input` (a string, or items: messages of role user, assistant, system or developer (developer is
system) whose content is a string or `input_text` / `output_text` / `input_image` parts (data URLs); `function_call`
items, merged into the assistant message before them as its `tool_calls`; `function_call_output` items, as tool
messages; `reasoning` items are dropped, as the chat path drops an assistant's `reasoning_content`), `instructions`
(a first system message), function `tools` in the flat shape, `tool_choice`, `temperature`, `top_p`,
`max_output_tokens`, `include: ["message.output_text.logprobs"]`, and `stream` (the finished response as
Responses' server-sent events, as the chat route streams).

Refused (400 naming the option), where honouring it is impossible here and ignoring it would change the answer:
`previous_response_id`, `conversation` and `prompt` (server-side state: nothing is stored; send the whole
conversation in `input`), `background: true`, hosted tools (web_search, file_search, ...: only the agent runs
tools), a `tool_choice` that is not a function, `text.format` other than text (no structured output is enforced),
`truncation: "auto"`, `top_logprobs` above 0, input items other than those above (`item_reference` among them).
Ignored, as they change nothing the model generates: `store` (nothing is ever stored), `reasoning` (the chat
template decides), `parallel_tool_calls`, `max_tool_calls`, `metadata`, `user`, `service_tier`, other `include`s.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError

from relax_gym.engines.base import RequestError
from relax_gym.engines.openai_api import ChatCompletionIn

#: options that need what this server does not have; the answer says why
REFUSED = {
    "previous_response_id": "this server keeps no responses; send the whole conversation in input (the earlier "
                            "input, the output items you got, then the new items)",
    "conversation": "this server keeps no conversations; send the whole conversation in input",
    "prompt": "this server keeps no stored prompts; send instructions and input",
    "background": "only false: a response is answered when it is done",
}
LOGPROBS = "message.output_text.logprobs"


class ResponsesIn(BaseModel):
    """A Responses request; options not declared here are ignored, but those in `REFUSED` (see `to_chat`)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    temperature: StrictFloat | None = Field(None, ge=0)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    max_output_tokens: StrictInt | None = Field(None, ge=1, le=2**31 - 1)
    include: list[str] | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0)
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream: StrictBool = False


def to_chat(body: ResponsesIn) -> ChatCompletionIn:
    """The chat-completions request of `body`; RequestError naming what it refuses (module docstring)."""
    for name, why in REFUSED.items():
        if (body.model_extra or {}).get(name) not in (None, False):
            raise RequestError(f"{name}: not supported: {why}")
    if body.truncation == "auto":
        raise RequestError("truncation: only 'disabled': a conversation past the context is refused, never cut")
    if body.top_logprobs:
        raise RequestError("top_logprobs: only 0: the chosen tokens' logprobs come with include "
                           f"[{LOGPROBS!r}], alternatives are not computed")
    if (kind := ((body.text or {}).get("format") or {}).get("type", "text")) != "text":
        raise RequestError(f"text.format: only 'text', got {kind!r}: no structured output is enforced here")
    if body.input is None:
        raise RequestError("input: required (a string or a list of items)")
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": _parts(body.instructions, "instructions")})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        _add_item(messages, item, f"input[{i}]")
    if not messages:
        raise RequestError("input: no messages")
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "logprobs": LOGPROBS in (body.include or []),
        "tools": [_tool(t, f"tools[{i}]") for i, t in enumerate(body.tools)] if body.tools else None,
        "tool_choice": _tool_choice(body.tool_choice),
        "max_completion_tokens": body.max_output_tokens,
    }
    chat |= {k: v for k in ("temperature", "top_p") if (v := getattr(body, k)) is not None}
    try:
        return ChatCompletionIn.model_validate(chat)
    except ValidationError as err:  # a message field of the wrong type, said as the chat route would
        raise RequestError(f"input: {err.errors()[0]['loc']}: {err.errors()[0]['msg']}") from None


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise RequestError(f"{where}.role: {role!r} is not taken (user, assistant, system, developer)")
        if role == "assistant":  # a string, as the proxy compares it with the reply it sent
            messages.append({"role": "assistant", "content": _assistant_text(item.get("content"), where)})
        else:
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _parts(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {"id": _str(item, "call_id", where), "type": "function",
                "function": {"name": _str(item, "name", where), "arguments": _str(item, "arguments", where)}}
        if messages and messages[-1]["role"] == "assistant":  # the same turn: its text, then its calls
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _str(item, "call_id", where),
                         "content": _parts(item.get("output"), f"{where}.output")})
    elif kind != "reasoning":  # dropped, as the chat path drops `reasoning_content`
        raise RequestError(f"{where}: item type {kind!r} is not taken (message, function_call, "
                           "function_call_output, reasoning); item_reference needs stored items, none are kept")


def _str(item: dict[str, Any], key: str, where: str) -> str:
    if not isinstance(value := item.get(key), str):
        raise RequestError(f"{where}.{key}: a string is required")
    return value


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    """Content as chat parts: a string is one text part, so `"hi"` and `[input_text "hi"]` are the same message
    (the proxy recognises a continued conversation by its messages)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}: a string or a list of parts is required")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": _str(part, "text", f"{where}[{j}]")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "input_image":
            raise RequestError(f"{where}[{j}].image_url: a data URL is required (file_id is not taken)")
        else:
            raise RequestError(f"{where}[{j}]: part type {kind!r} is not taken (input_text, output_text, "
                               "input_image)")
    return parts


def _assistant_text(content: Any, where: str) -> str:
    parts = _parts(content if content is not None else "", f"{where}.content")
    if any(p["type"] != "text" for p in parts):
        raise RequestError(f"{where}.content: an assistant message holds text only")
    return "".join(p["text"] for p in parts)


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise RequestError(f"{where}: type {tool.get('type')!r} is not taken: only function tools (the agent "
                           "runs them); hosted tools do not run here")
    _str(tool, "name", where)
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if tool.get(k) is not None}}


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(f"tool_choice: {choice!r} is not taken ('auto', 'none', 'required' or "
                       "{type: 'function', name})")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def from_chat(completion: dict[str, Any], body: ResponsesIn) -> dict[str, Any]:
    """The Responses object of a one-choice chat completion: reasoning, the message and the function calls as
    output items; a reply cut at its token budget is "incomplete" (max_output_tokens)."""
    [choice] = completion["choices"]
    reply = choice["message"]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    calls = reply.get("tool_calls") or []
    output: list[dict[str, Any]] = []
    if reply.get("reasoning_content"):
        output.append({"id": _id("rs"), "type": "reasoning", "status": status, "summary": [],
                       "content": [{"type": "reasoning_text", "text": reply["reasoning_content"]}]})
    if reply.get("content") or not calls:
        part: dict[str, Any] = {"type": "output_text", "text": reply.get("content") or "", "annotations": []}
        if choice["logprobs"]:
            part["logprobs"] = [{"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode()),
                                 "top_logprobs": []} for t in choice["logprobs"]["content"]]
        output.append({"id": _id("msg"), "type": "message", "role": "assistant", "status": status,
                       "content": [part]})
    output += [{"id": _id("fc"), "type": "function_call", "status": "completed", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"]} for call in calls]
    usage = completion["usage"]
    return {
        "id": _id("resp"), "object": "response", "created_at": completion["created"], "model": completion["model"],
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "output": output,
        "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
        "previous_response_id": None, "store": False, "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                  "total_tokens": usage["total_tokens"],
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


def respond(answer: Any, body: ResponsesIn) -> Any:
    """What a `/v1/responses` route answers: the chat path's refusal (a `Response`) as it is, else the Responses
    object of its completion, as server-sent events when `body` streams (`openai_routes`' `/v1/responses`, which the
    agent proxy and `relax-gym serve` both answer)."""
    from fastapi.responses import Response, StreamingResponse

    if isinstance(answer, Response):
        return answer
    response = from_chat(answer, body)
    if body.stream:
        return StreamingResponse(stream_events(response), media_type="text/event-stream")
    return response


def stream_events(response: dict[str, Any]) -> Iterator[str]:
    """A finished response as Responses' server-sent events: created, each output item added, its text or
    arguments in one delta, done, then completed (or incomplete)."""
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {**response, "status": "in_progress", "output": [], "usage": None}},
        {"type": "response.in_progress", "response": {**response, "status": "in_progress", "output": [],
                                                      "usage": None}}]
    for index, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            events.append({"type": "response.output_item.added", "output_index": index, "item": {**item,
                                                                                               "content": []}})
            for j, part in enumerate(item["content"]):
                events += [
                    {"type": "response.content_part.added", **at, "content_index": j,
                     "part": {**part, "text": "", "logprobs": []}},
                    {"type": "response.output_text.delta", **at, "content_index": j, "delta": part["text"],
                     "logprobs": part.get("logprobs", [])},
                    {"type": "response.output_text.done", **at, "content_index": j, "text": part["text"],
                     "logprobs": part.get("logprobs", [])},
                    {"type": "response.content_part.done", **at, "content_index": j, "part": part}]
        elif item["type"] == "function_call":
            events += [
                {"type": "response.output_item.added", "output_index": index, "item": {**item, "arguments": ""}},
                {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", **at, "name": item["name"],
                 "arguments": item["arguments"]}]
        else:
            events.append({"type": "response.output_item.added", "output_index": index, "item": item})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": f"response.{response['status']}", "response": response})
    for number, event in enumerate(events):
        yield f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': number})}\n\n"
