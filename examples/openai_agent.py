"""A multi-turn tool agent written only against the `openai` package, trained as an env.

The agent is ordinary OpenAI client code: it asks the model about the weather in a city with a `get_weather`
tool, runs the tool itself when the model calls it, sends the result back, and scores the final answer.
`AgentEnv` makes it a registered env, so the rollout manager runs it with a client pointed at its own
session of the agent proxy, which records the exact tokens for training.

    relax-gym check examples/openai_agent.py
    relax-gym rollout --env examples/openai_agent.py --model tiny -n 4 --out agent.jsonl
    relax-gym train examples/configs/quickstart.yaml envs='[{id: examples/openai_agent.py}]' trainer.total_steps=3 \
        rollout.max_total_tokens=1024 rollout.max_new_tokens=64

(The agent's prompt, with its tool schema, is about 250 tokens: more than the quickstart's budget of 128.)
"""

import json

import relax_gym
from relax_gym.env.agent_env import AgentEnv

WEATHER = {"Paris": 18, "Oslo": 3, "Cairo": 31, "Lima": 22, "Tokyo": 15}
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The temperature in a city, in degrees Celsius.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]


def get_weather(city: str) -> str:
    return json.dumps({"city": city, "temp_c": WEATHER.get(city)})


async def weather_agent(client, task, max_rounds: int = 3) -> float:
    """Up to `max_rounds` model calls; 1.0 when the final answer states the city's temperature."""
    messages = [{"role": "user", "content": f"What is the temperature in {task['city']} now? Use the tool."}]
    for _ in range(max_rounds):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                     max_tokens=64)
        answer = reply.choices[0].message
        messages.append(answer.model_dump(exclude_none=True))
        if not answer.tool_calls:
            return float(str(WEATHER[task["city"]]) in (answer.content or ""))
        for call in answer.tool_calls:
            arguments = json.loads(call.function.arguments or "{}")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": get_weather(str(arguments.get("city", "")))})
    return 0.0


def weather_task(rng) -> dict:
    return {"city": sorted(WEATHER)[int(rng.integers(len(WEATHER)))]}


relax_gym.register("example/OpenAIAgent-v0", lambda: AgentEnv(weather_agent, tasks=weather_task))
