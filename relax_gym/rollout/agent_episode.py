"""One agent episode under the rollout manager: the agent runs against its own proxy session, and each chain
of its calls becomes a trajectory (`relax_gym.rollout.agent_proxy`)."""

from __future__ import annotations

import asyncio
import time
import traceback
from typing import Any

from relax_gym.env.agent_env import AgentEnv, task_text
from relax_gym.rewards import RewardResult
from relax_gym.rollout.agent_proxy import Chain, ProxyServer
from relax_gym.trajectory import Status, Trajectory


async def play_agent(server: ProxyServer, env: AgentEnv, env_id: str, seed: int, group_id: str, member: int, *,
                     sampling_seed: int | None, timeout_s: float) -> list[Trajectory]:
    """Runs `env.agent` on the task `seed` names with a client on a fresh session of `server` (started here if it
    is not running on this loop); its chains as trajectories. `sampling_seed`: the run's, which seeds each call."""
    import openai

    proxy, url = await server.get()
    task = env.draw_task(seed)
    sid = proxy.open(None if sampling_seed is None else (sampling_seed, seed, member, "agent"))
    client = openai.AsyncOpenAI(base_url=f"{url}/s/{sid}/v1", api_key=proxy.api_key, max_retries=0,
                                timeout=timeout_s)
    status: Status = "completed"
    reason, reward, detail = "", 0.0, None
    started = time.perf_counter()
    try:
        result = await asyncio.wait_for(env.agent(client, task), timeout_s)
        if isinstance(result, RewardResult):
            reward, detail = result.score, result.to_info()
        else:
            reward = float(result)
    except TimeoutError:
        status, reason = "aborted", f"agent timed out after {timeout_s}s"
    except Exception as err:
        frames = traceback.extract_tb(err.__traceback__)
        # the agent's own line that raised, not the openai package's
        frame = next((f for f in reversed(frames) if "site-packages" not in f.filename), frames[-1])
        status, reason = "failed", f"agent raised {type(err).__name__}: {err} ({frame.filename}:{frame.lineno})"
    finally:
        session = proxy.close(sid)
        await client.close()
    chains = [c for c in session.chains if c.conv.turns]  # a chain whose only call failed or was refused: no sample
    if session.refused and not chains and status != "aborted":
        status, reason = "failed", session.refused  # whatever the agent made of the refusal
    elif not chains and status == "completed":
        status, reason = "failed", "the agent made no model call"
    if session.error and status == "completed":
        reason = f"a model call failed: {session.error}"
    if session.truncated and status != "aborted":  # the run's limit ended it, whatever the agent did then
        status, reason = "truncated", session.truncated
    metrics: dict[str, Any] = {"agent_s": round(time.perf_counter() - started, 6), "agent_calls": session.calls,
                               "agent_chains": len(chains)}
    if detail and detail.get("status") != "ok":
        metrics["reward_status"] = detail["status"]
    if not chains:
        return [_empty(env_id, group_id, seed, task, status, reason, metrics)]
    return [_trajectory(chain, i, env_id, group_id, seed, task, reward, status, reason, metrics)
            for i, chain in enumerate(chains)]


def _trajectory(chain: Chain, index: int, env_id: str, group_id: str, seed: int, task: Any,
                reward: float, status: Status, reason: str, metrics: dict[str, Any]) -> Trajectory:
    conv = chain.conv
    traj = Trajectory(
        token_ids=conv.token_ids, prompt_len=conv.prompt_len, loss_mask=conv.loss_mask,
        rollout_logprobs=conv.logprobs, versions=conv.versions, reward=reward, step_rewards=[reward],
        status=status, status_reason=reason, group_id=group_id, env_id=env_id, task=task_text(task)[:500],
        segments=conv.segments, media=conv.media, mm_inputs=conv.mm_inputs(), routed_experts=chain.routes,
        metrics={**metrics, "turns": conv.turns, "agent_chain": index}, seed=seed,
    )
    traj.check()
    return traj


def _empty(env_id: str, group_id: str, seed: int, task: Any, status: Status, reason: str,
           metrics: dict[str, Any]) -> Trajectory:
    return Trajectory(token_ids=[], prompt_len=0, loss_mask=[], rollout_logprobs=[], versions=[], reward=0.0,
                      step_rewards=[], status=status, status_reason=reason, group_id=group_id, env_id=env_id,
                      task=task_text(task)[:500], metrics={**metrics, "turns": 0}, seed=seed)
