import json

import pytest

from relax_gym import ToolEnv, tool
from relax_gym.core import EpisodeOverError
from relax_gym.tools import ToolError


class Lookup(ToolEnv):
    """Find a value with a tool."""

    max_turns = 3

    def new_task(self, rng, options):
        key = ["a", "b", "c"][int(rng.integers(3))]
        return {"prompt": f"What is the value of {key}?", "key": key}

    @tool
    def value(self, key: str) -> int:
        """Looks a value up.

        Args:
            key: a single letter
        """
        if key not in "abc":
            raise ToolError(f"no value for {key!r}; keys are a, b, c")
        return ord(key)

    def score(self, answer):
        return float(answer.strip() == str(ord(self.episode["task"]["key"])))


def call(args) -> str:
    return "<tool_call>" + json.dumps({"name": "value", "arguments": args}) + "</tool_call>"


def test_tool_turn_then_answer_counts_and_scores():
    env = Lookup()
    obs, info = env.reset(seed=0)
    assert obs[0]["role"] == "user" and info == {"turn": 0, "tool_calls": 0, "tool_successes": 0, "tool_errors": 0}
    key = env.episode["task"]["key"]
    obs, reward, terminated, truncated, info = env.step(call({"key": key}) + call({"key": "z"}) + "<tool_call>{")
    assert [m["role"] for m in obs] == ["tool", "tool", "tool"]
    texts = [m["content"][0]["text"] for m in obs]
    assert "unclosed" in texts[0]
    assert texts[1] == str(ord(key))
    assert texts[2] == "Error: value: no value for 'z'; keys are a, b, c"
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info == {"turn": 1, "tool_calls": 2, "tool_successes": 1, "tool_errors": 2}
    obs, reward, terminated, truncated, info = env.step(str(ord(key)))
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["reward"]["status"] == "ok"
    with pytest.raises(EpisodeOverError):
        env.step("again")


def test_turn_limit_truncates():
    env = Lookup(max_turns=2)
    env.reset(seed=1)
    assert env.step(call({"key": "a"}))[3] is False
    _, reward, terminated, truncated, info = env.step(call({"key": "a"}))
    assert (reward, terminated, truncated, info["truncated_by"]) == (0.0, False, True, "max_turns")


def test_state_round_trip_resumes_the_episode():
    env = Lookup()
    env.reset(seed=2)
    env.step(call({"key": "b"}))
    snapshot = env.get_state()
    expected = env.step(call({"key": "c"}))
    other = Lookup()
    other.set_state(snapshot)
    assert other.step(call({"key": "c"})) == expected


def test_step_before_reset_is_a_clear_error():
    with pytest.raises(EpisodeOverError, match="reset"):
        Lookup().step("hi")


def test_tools_are_offered_with_schemas():
    env = Lookup()
    assert env.metadata["tools"] == ("value",)
    assert env.tool_schemas[0]["function"]["parameters"]["properties"]["key"]["type"] == "string"
    with pytest.raises(ValueError):
        Lookup(max_turns=0)


def test_blocking_envs_step_in_a_thread_and_fast_ones_on_the_loop():
    import asyncio
    import threading

    from relax_gym.envs.procedural import GuessNumberEnv

    class Where(GuessNumberEnv):
        def step(self, action):
            self.thread = threading.current_thread()
            return super().step(action)

    class SlowWhere(Where):
        blocking = True

    for cls, on_loop in ((Where, True), (SlowWhere, False)):
        env = cls()

        async def run(env=env):
            await env.areset(seed=0)
            await env.astep("5")

        asyncio.run(run())
        assert (env.thread is threading.main_thread()) == on_loop
