"""Actions a policy under training can emit that must not hold or crash an env: floods of tool calls,
megabyte replies, JSON nested past the recursion limit, numbers past int's digit limit.

The `timeout` marks are hang guards for the whole test, not measurements.
"""

from __future__ import annotations

import json

import pytest

import relax_gym
from relax_gym.tools import parse_tool_calls

pytestmark = pytest.mark.filterwarnings("ignore::relax_gym.sandbox.SandboxFallbackWarning")

DEEP = 100_000
HOSTILE_BLOCKS = {
    "nested-list": "[" * DEEP + "]" * DEEP,
    "nested-object": '{"a": ' * DEEP + "1" + "}" * DEEP,
    "nested-arguments": '{"name": "python", "arguments": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}",
    "nested-arguments-string": json.dumps({"name": "python", "arguments": "[" * DEEP + "]" * DEEP}),
    "huge-int": '{"name": "python", "arguments": {"code": ' + "9" * 10_000 + "}}",
    "huge-int-in-string-arguments": json.dumps({"name": "python", "arguments": '{"code": ' + "9" * 10_000 + "}"}),
}


def python_call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


@pytest.mark.parametrize("body", HOSTILE_BLOCKS.values(), ids=HOSTILE_BLOCKS.keys())
def test_parser_turns_hostile_json_into_a_readable_error(body: str) -> None:
    turn = parse_tool_calls(f"before <tool_call>{body}</tool_call> after")
    assert turn.content == "before  after" and not turn.calls
    (error,) = turn.errors
    assert "JSON" in error.message and len(error.message) < 200, error.message


@pytest.mark.timeout(120)
def test_parser_is_linear_on_a_megabyte_of_opening_tags() -> None:
    """A lazy `<tool_call>(.*?)</tool_call>` regex rescans the rest of the text from every unclosed tag."""
    text = "<tool_call>" * 100_000
    turn = parse_tool_calls(text)
    assert not turn.calls and len(turn.errors) == 1 and "unclosed" in turn.errors[0].message
    turn = parse_tool_calls("<tool_call>" * 100_000 + python_call("print(1)"))
    assert not turn.calls and len(turn.errors) == 1  # the first opening tag swallows the rest, as before


@pytest.fixture
def math_tool():
    env = relax_gym.make("relax/MathTool-v0", max_turns=3)
    env.reset(seed=0)
    yield env
    env.close()


@pytest.mark.timeout(300)
def test_a_hundred_sandboxed_calls_run_at_most_the_cap(math_tool) -> None:
    cap = math_tool.unwrapped.max_tool_calls_per_turn
    action = "".join(python_call(f"print({i} * 11)") for i in range(100))
    obs, reward, terminated, truncated, info = math_tool.step(action)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert (info["tool_calls"], info["tool_successes"], info["tool_errors"]) == (cap, cap, 100 - cap)
    assert [m["name"] for m in obs] == ["python"] * cap + ["tool_call_limit"]
    for i, message in enumerate(obs[:cap]):  # run concurrently, reported in call order
        assert str(i * 11) in message["content"][0]["text"], message
    assert f"{100 - cap} more tool call(s) were not run" in obs[-1]["content"][0]["text"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "action",
    [
        "x" * 2**20 + python_call("print(6 * 7)"),
        python_call("print(6 * 7)") + "<tool_call>" + HOSTILE_BLOCKS["nested-list"] + "</tool_call>",
        python_call("print(6 * 7)") + "<tool_call>" + HOSTILE_BLOCKS["huge-int"] + "</tool_call>",
        python_call("print(6 * 7)") + "<tool_call>" * 100_000,
    ],
    ids=["megabyte-prose", "nested-json", "huge-int", "many-unclosed-tags"],
)
def test_hostile_actions_become_observations_the_episode_goes_on(math_tool, action: str) -> None:
    obs, reward, terminated, truncated, info = math_tool.step(action)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["tool_successes"] == 1
    assert any("42" in m["content"][0]["text"] for m in obs if m["name"] == "python")
    _, _, terminated, _, info = math_tool.step("\\boxed{1}")
    assert terminated and info["reward"]["status"] in ("ok", "error")


def test_zoom_floods_stop_at_the_cap_and_compound_in_call_order() -> None:
    """DeepEyes' zooms build on the current view, so they run one after another in call order."""
    env = relax_gym.make("relax/DeepEyes-v0", bbox_format="normalized")
    env.reset(seed=0)
    zoom = '<tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [0, 0, 500, 500]}}</tool_call>'
    obs, *_, info = env.step(zoom * 100)
    assert (info["tool_calls"], info["tool_successes"], info["tool_errors"]) == (4, 4, 96)
    assert info["view"]["box"] == [0, 0, 56, 42]  # four halvings of 896x672, each of the view before
    assert [m["name"] for m in obs] == ["image_zoom_in"] * 4 + ["tool_call_limit"]
