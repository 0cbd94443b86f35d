"""Agents written against OpenAI's Responses API train through the agent proxy (`/s/{session}/v1/responses`): a
Responses episode with a tool round trip is one chain whose recorded tokens, loss mask and logprobs are exactly
those of the same conversation through chat completions, and a refused option is the agent's 400."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from relax_gym.engines.scripted import ScriptedEngine
from relax_gym.env.agent_env import AgentEnv
from relax_gym.env.registration import register
from relax_gym.models import load_model
from relax_gym.rollout import RolloutLimits, RolloutManager
from relax_gym.tools.formats import tool_format_of

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": PARAMETERS}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": PARAMETERS}}
ANSWER = "It is 18 degrees."


async def _responses_agent(client, task) -> float:
    items: list = [{"role": "user", "content": "Weather in Paris?"}]
    first = await client.responses.create(model="p", input=items, tools=[WEATHER], instructions="Use tools.")
    [call] = [item for item in first.output if item.type == "function_call"]
    items += [*first.output, {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'}]
    second = await client.responses.create(model="p", input=items, tools=[WEATHER], instructions="Use tools.")
    return float(second.output_text == ANSWER)


async def _chat_agent(client, task) -> float:
    messages: list = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]
    first = (await client.chat.completions.create(model="p", messages=messages, tools=[CHAT_WEATHER])).choices[0]
    messages += [first.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.message.tool_calls[0].id, "content": '{"temp_c": 18}'}]
    second = await client.chat.completions.create(model="p", messages=messages, tools=[CHAT_WEATHER])
    return float(second.choices[0].message.content == ANSWER)


async def _refused_agent(client, task) -> float:
    refused = False
    try:
        await client.responses.create(model="p", input="hi", previous_response_id="resp_1")
    except openai.BadRequestError as err:
        refused = "previous_response_id:" in err.message
    answer = await client.responses.create(model="p", input="hi")
    return float(refused and answer.output_text == "x")


def _run(loaded, engine, env_id: str):
    manager = RolloutManager(engine, loaded, limits=RolloutLimits(episode_timeout_s=60))

    async def go():
        try:
            return await manager.run(env_id, 1, 1)
        finally:
            await manager.close()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def test_a_responses_episode_records_the_tokens_of_the_same_chat_episode(tiny):
    fmt = tool_format_of(tiny)

    def policy(turn):
        if turn.turn == 0:
            return fmt.write_calls([("get_weather", {"city": "Paris"})], "Let me look.")
        assert json.loads(turn.text.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]) == {"temp_c": 18}
        return ANSWER

    register("test/ResponsesAgent-v0", lambda: AgentEnv(_responses_agent, tasks=["t"]))
    register("test/ChatAgent-v0", lambda: AgentEnv(_chat_agent, tasks=["t"]))
    [responses] = _run(tiny, ScriptedEngine(tiny, policy, logprob=-0.5), "test/ResponsesAgent-v0")
    [chat] = _run(tiny, ScriptedEngine(tiny, policy, logprob=-0.5), "test/ChatAgent-v0")
    for traj in (responses, chat):
        assert (traj.status, traj.reward) == ("completed", 1.0), traj.status_reason
        assert traj.metrics["agent_chains"] == 1 and traj.metrics["turns"] == 2
    assert responses.token_ids == chat.token_ids and responses.loss_mask == chat.loss_mask
    assert responses.rollout_logprobs == chat.rollout_logprobs and sum(responses.loss_mask) > 0


def test_a_refused_option_is_the_agents_400_and_costs_no_call(tiny):
    register("test/RefusedResponses-v0", lambda: AgentEnv(_refused_agent, tasks=["t"]))
    [traj] = _run(tiny, ScriptedEngine(tiny, ["x"]), "test/RefusedResponses-v0")
    assert (traj.status, traj.reward, traj.metrics["agent_calls"]) == ("completed", 1.0, 1), traj.status_reason
