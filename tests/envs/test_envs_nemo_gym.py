"""relax/NeMoGym-v0 against servers with NeMo Gym's wire format (tests/support/nemo_gym_server.py), over HTTP."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.engines import serving_app
from support.nemo_gym_server import gymnasium_server, rows, temperature, verify_server

import relax_gym
from relax_gym.cli import main

ENV_ID = "relax/NeMoGym-v0"
WEATHER_CALL = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def weather(tmp_path_factory) -> Iterator[dict[str, str]]:
    data = tmp_path_factory.mktemp("nemo") / "weather.jsonl"
    data.write_text("\n".join(rows("verify")) + "\n")
    with serving_app(verify_server()) as url:
        yield {"url": url, "data": str(data)}


@pytest.fixture(scope="module")
def guessing(tmp_path_factory) -> Iterator[dict[str, str]]:
    data = tmp_path_factory.mktemp("nemo") / "guess.jsonl"
    data.write_text("\n".join(rows("gymnasium")) + "\n")
    with serving_app(gymnasium_server()) as url:
        yield {"url": url, "data": str(data)}


def text(observation) -> str:
    return "\n".join(part["text"] for m in observation for part in m["content"] if part["type"] == "text")


def city_of(prompt: str) -> str:
    return re.findall(r"How warm is it in (\w+)\?", prompt)[-1]


def test_a_verify_server_runs_the_rows_own_tools_in_its_session_and_grades(weather):
    env = relax_gym.make(ENV_ID, **weather)
    assert env.kind == "verify"
    obs, info = env.reset(seed=3)
    assert obs[0]["role"] == "system"  # the row's developer message
    city = city_of(text(obs))
    assert [s["function"]["name"] for s in env.tool_schemas] == ["get_weather"]  # the row's own tool
    assert env.tool_schemas[0]["function"]["parameters"]["required"] == ["city"]
    obs, reward, terminated, _, _ = env.step(WEATHER_CALL.format(city=city))
    assert not terminated and f'"temperature_c": {temperature(city)}' in text(obs)
    _, reward, terminated, _, info = env.step(f"It is {temperature(city)} degrees.")
    assert terminated and reward == 1.0 and info["reward"]["status"] == "ok"
    output = [item["type"] for item in env.episode["output"]]
    assert output == ["function_call", "function_call_output", "message"]


def test_the_answer_counts_only_after_asking_in_the_same_session(weather):
    env = relax_gym.make(ENV_ID, **weather)
    obs, _ = env.reset(seed=3)
    city = city_of(text(obs))
    env.step(WEATHER_CALL.format(city=city))
    env.reset(seed=3)  # a new episode is a new session: the earlier call is not in it
    assert env.step(f"It is {temperature(city)} degrees.")[1] == 0.0


def test_bad_tool_arguments_are_checked_against_the_rows_schema(weather):
    env = relax_gym.make(ENV_ID, **weather)
    env.reset(seed=0)
    obs = env.step('<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}\n</tool_call>')[0]
    assert "invalid arguments" in text(obs) and "city" in text(obs)


def test_a_gymnasium_server_takes_every_turn_through_step(guessing):
    env = relax_gym.make(ENV_ID, **guessing, max_turns=10)
    assert env.kind == "gymnasium"
    obs, _ = env.reset(seed=1)
    assert "thinking of a number" in text(obs)  # /reset's observation follows the row's messages
    low, high, reward, done = 1, 100, 0.0, False
    while not done:
        guess = (low + high) // 2
        obs, reward, terminated, truncated, _ = env.step(str(guess))
        done = terminated or truncated
        if "higher" in text(obs):
            low = guess + 1
        elif "lower" in text(obs):
            high = guess - 1
    assert terminated and reward == 1.0


def test_a_gymnasium_episode_stops_at_max_turns(guessing):
    env = relax_gym.make(ENV_ID, **guessing, max_turns=2)
    env.reset(seed=0)
    env.step("1")
    _, _, terminated, truncated, info = env.step("2")
    assert truncated and not terminated and info["truncated_by"] == "max_turns"


@pytest.mark.parametrize("server", ["weather", "guessing"])
def test_relax_gym_check_passes(server, request, capsys):
    kwargs = request.getfixturevalue(server)
    args = [arg for key, value in kwargs.items() for arg in ("--env-arg", f"{key}={value}")]
    assert main(["check", ENV_ID, *args, "--json"]) == 0, capsys.readouterr().out
    (report,) = json.loads(capsys.readouterr().out)
    assert report["passed"]


def test_errors_name_the_file_the_line_and_the_server(tmp_path, weather):
    with pytest.raises(FileNotFoundError, match="no such data file"):
        relax_gym.make(ENV_ID, url=weather["url"], data=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"responses_create_params": {"input": "hi"}}\n{"question": "no request"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: a NeMo Gym row needs responses_create_params\.input"):
        relax_gym.make(ENV_ID, url=weather["url"], data=str(bad))
    with pytest.raises(ConnectionError, match="is the resources server running"):
        relax_gym.make(ENV_ID, url="http://127.0.0.1:9", data=weather["data"])


def test_the_rollout_manager_reaches_reward_one_through_the_tool(weather):
    """The tiny model's chat template and tool format, a scripted engine: call the tool, then answer from it."""
    from relax_gym.engines import ScriptedEngine
    from relax_gym.models import load_model
    from relax_gym.rollout import RolloutManager

    def reply(turn) -> str:
        found = re.findall(r'"temperature_c": (\d+)', turn.text)
        return f"It is {found[-1]} degrees." if found else WEATHER_CALL.format(city=city_of(turn.text))

    loaded = load_model("tiny")
    manager = RolloutManager(ScriptedEngine(loaded, reply), loaded)
    trajectories = asyncio.run(manager.run(ENV_ID, n_tasks=3, group_size=2, env_kwargs=weather))
    assert {t.status for t in trajectories} == {"completed"}
    assert [t.reward for t in trajectories] == [1.0] * 6
    assert all(len(t.infos) == 3 for t in trajectories)  # reset, the tool turn, the answer
    assert Path(weather["data"]).is_file()
