"""`relax-gym check` runs an `AgentEnv`'s agent once against a scripted engine (`rollout/agent_check.py`): an
agent that raises or never calls the model fails the check it used to pass, and the example agent passes it."""

from __future__ import annotations

import json
from pathlib import Path

from relax_gym.cli import main
from relax_gym.env.agent_env import AgentEnv
from relax_gym.env.conformance import FAILED, PASSED
from relax_gym.rollout.agent_check import AGENT_CHECK, REPLY, check_agent

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "openai_agent.py"


async def _echoes(client, task):
    reply = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": str(task)}])
    return float(reply.choices[0].message.content == REPLY)


async def _raises(client, task):
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": str(task)}])
    raise KeyError("answer")


async def _never_calls(client, task):
    return 1.0


def test_an_agent_that_calls_the_model_passes_and_sees_the_scripted_reply():
    result = check_agent("echo", lambda: AgentEnv(_echoes, tasks=["t"]))
    assert result is not None and result.status == PASSED, result
    assert result.detail.startswith("1 model call over 1 chain, reward 1")


def test_an_agent_that_raises_or_never_calls_the_model_fails_with_why():
    raised = check_agent("raises", lambda: AgentEnv(_raises, tasks=["t"]))
    assert raised is not None and raised.status == FAILED and "agent raised KeyError" in raised.detail
    idle = check_agent("idle", lambda: AgentEnv(_never_calls, tasks=["t"]))
    assert idle is not None and idle.status == FAILED and "made no model call" in idle.detail


def test_the_example_agent_passes_through_the_cli_and_other_envs_get_no_agent_check(capsys):
    assert main(["check", str(EXAMPLE), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert {r["name"]: r["status"] for r in report["results"]}[AGENT_CHECK] == "passed"
    assert main(["check", "relax/Arithmetic-v0", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert AGENT_CHECK not in {r["name"] for r in report["results"]}
