"""OpenAI's Responses API on `relax-gym serve` (`/v1/responses`, `relax_gym.engines.responses_api`), driven by the
real `openai` client over loopback: the answer is the chat completion's in Responses' shape (the official model
parses it), a tool call makes the round trip, it streams, and what it cannot honour is a 400 naming the option."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from openai.types.responses import Response
from support.engines import KEY, Served, post, served

from relax_gym.engines.responses_api import ResponsesIn, to_chat
from relax_gym.engines.scripted import ScriptedEngine
from relax_gym.models import load_model
from relax_gym.tools.formats import tool_format_of

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    with served(load_model("tiny")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)


def test_a_response_is_the_chat_completion_in_responses_shape(server, client):
    asked = {"model": "tiny", "temperature": 0, "max_output_tokens": 8}
    chat = client.chat.completions.create(model="tiny", messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
        temperature=0, max_tokens=8, logprobs=True)
    response = client.responses.create(input="What is 2+2?", instructions="Be brief.", **asked,
                                       include=["message.output_text.logprobs"])
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    [message] = response.output
    assert [lp.logprob for lp in message.content[0].logprobs] == pytest.approx(
        [lp.logprob for lp in chat.choices[0].logprobs.content])
    raw = post(f"{server.url}/v1/responses", json={**asked, "input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": "What is 2+2?"}]}, timeout=60)
    strict = Response.model_validate(raw.json())  # the official model, validating, not constructing
    assert strict.output_text == response.output_text and strict.id.startswith("resp_")
    events = list(client.responses.create(input="What is 2+2?", instructions="Be brief.", stream=True, **asked))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == "response.incomplete"  # as OpenAI ends a response cut at max_output_tokens
    assert "".join(deltas) == events[-1].response.output_text == response.output_text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong").responses.create(model="tiny", input="hi")


def test_a_function_call_makes_the_round_trip(server, client, monkeypatch):
    """The model calls the tool (a scripted reply on the served engine), the client sends the call's output back
    with the output items it got, and the model answers; the template saw the result."""
    tiny = server.engine.loaded
    seen: list[str] = []

    def policy(turn):
        seen.append(turn.text)
        if turn.turn == 0:
            return tool_format_of(tiny).write_calls([("get_weather", {"city": "Paris"})], "Let me look.")
        return "It is 18 degrees."

    scripted = ScriptedEngine(tiny, policy)

    async def generate(request, timeout_s=None):
        return await scripted.generate(request)

    monkeypatch.setattr(server.engine, "generate", generate)
    items: list = [{"role": "user", "content": "Weather in Paris?"}]
    with client.responses.stream(model="tiny", input=items, tools=[WEATHER]) as stream:
        first = stream.get_final_response()
    message, call = first.output
    assert message.content[0].text == "Let me look." and first.status == "completed"
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    items += [*first.output, {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'}]
    second = client.responses.create(model="tiny", input=items, tools=[WEATHER], tool_choice="auto")
    assert second.output_text == "It is 18 degrees." and [o.type for o in second.output] == ["message"]
    assert '<tool_response>\n{"temp_c": 18}\n</tool_response>' in seen[1] and "get_weather" in seen[1]


@pytest.mark.parametrize(("option", "asked"), [
    ("previous_response_id", {"previous_response_id": "resp_1"}),
    ("conversation", {"conversation": "conv_1"}),
    ("background", {"background": True}),
    ("tools[0]", {"tools": [{"type": "web_search"}]}),
    ("tool_choice", {"tool_choice": {"type": "file_search"}}),
    ("text.format", {"text": {"format": {"type": "json_object"}}}),
    ("truncation", {"truncation": "auto"}),
    ("top_logprobs", {"top_logprobs": 3}),
    ("input[0]", {"input": [{"type": "item_reference", "id": "msg_1"}]}),
    ("input[0].content[0]", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_option(client, option, asked):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"model": "tiny", "input": "hi", **asked})
    assert f"{option}:" in refused.value.message


def test_the_translation_to_chat():
    """Developer is system, a string is one text part, an image is an image_url part, a turn's function calls join
    its message, and reasoning items are dropped, as the chat path drops reasoning_content."""
    body = ResponsesIn(input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Which?"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Look.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}],
        tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=5)
    chat = to_chat(body)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Which?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "Look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "1"}]}]
    assert chat.tools == [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                    "parameters")}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.max_completion_tokens == 5 and not chat.logprobs
