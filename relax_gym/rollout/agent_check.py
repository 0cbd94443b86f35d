"""`relax-gym check` for an `AgentEnv`: its agent runs once, through the agent proxy, against a scripted engine.

The env checks (`relax_gym.env.conformance`) see an `AgentEnv` only as a gymnasium env, whose `step` ends the
episode without running the agent: an agent that raises, never calls the model, or calls it in a way the proxy
refuses passed them all. Here the agent runs as `relax-gym rollout` runs it (`play_agent`, a session of the
proxy, the exact-token bookkeeping), with the tiny model's tokenizer and template behind the proxy and
`ScriptedEngine` answering every call with `REPLY`, so no weights run and nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from relax_gym.engines import SamplingParams, ScriptedEngine
from relax_gym.env.agent_env import AgentEnv
from relax_gym.env.conformance import FAILED, PASSED, CheckResult
from relax_gym.env.core import Env
from relax_gym.models import load_model
from relax_gym.rollout.agent_episode import play_agent
from relax_gym.rollout.agent_proxy import ProxyServer
from relax_gym.rollout.config import RolloutLimits
from relax_gym.trajectory import Trajectory

__all__ = ["AGENT_CHECK", "REPLY", "check_agent"]

AGENT_CHECK = "agent runs against a scripted engine"
#: what the scripted engine answers every model call with
REPLY = "I do not know."
TIMEOUT_S = 120.0


async def _play(env: AgentEnv, name: str) -> list[Trajectory]:
    loaded = load_model("tiny")
    engine = ScriptedEngine(loaded, lambda _: REPLY)
    server = ProxyServer(engine, loaded, SamplingParams(max_new_tokens=64), RolloutLimits())
    try:
        return await play_agent(server, env, name, seed=0, group_id="check", member=0, sampling_seed=0,
                                timeout_s=TIMEOUT_S)
    finally:
        await server.stop()
        await engine.close()


def check_agent(name: str, make_env: Callable[[], Env]) -> CheckResult | None:
    """Runs the agent of the `AgentEnv` `make_env` makes on seed 0's task; None for any other env, or when
    `make_env` fails (the env checks report that). It passes when the episode ends completed or truncated by the
    run's limits, and fails with the episode's reason otherwise (the agent raised, timed out, made no model call,
    or every call was refused)."""
    try:
        env = make_env()
    except Exception:
        return None
    try:
        if not isinstance(env, AgentEnv):
            return None
        trajectories = asyncio.run(_play(env, name))
    except Exception as err:
        return CheckResult(AGENT_CHECK, FAILED, f"{type(err).__name__}: {err}")
    finally:
        env.close()
    first = trajectories[0]
    if first.status not in ("completed", "truncated"):
        return CheckResult(AGENT_CHECK, FAILED, f"episode {first.status}: {first.status_reason}")
    calls = first.metrics.get("agent_calls", 0)
    return CheckResult(AGENT_CHECK, PASSED, f"{calls} model call{'s' * (calls != 1)} over {len(trajectories)} "
                                           f"chain{'s' * (len(trajectories) != 1)}, reward {first.reward:g}, "
                                           f"{first.status}")
