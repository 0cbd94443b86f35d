"""`AgentEnv`: any agent program that talks to an OpenAI-style API, as a registered env.

    async def agent(client: openai.AsyncOpenAI, task) -> float | RewardResult:
        ...  # any number of client.chat.completions.create(...) calls, tools run by the agent itself

    relax_gym.register("me/MyAgent-v0", lambda: AgentEnv(agent, tasks=my_tasks))

Under `relax-gym rollout` and `relax-gym train` the rollout manager runs the agent itself: each episode gets a
client pointed at its own session of the agent proxy (`relax_gym.rollout.agent_proxy`), which generates on the run's
engine and records the exact tokens; the agent's return value is the episode's reward. An agent that raises
ends its episode `failed` with the reason; one that outlives `rollout.episode_timeout_s` is `aborted`.

As a plain gymnasium env (what the env checks exercise) an `AgentEnv` shows its task: `reset` draws it
from the seed and presents it as a user message, and `step` ends that episode with reward 0, since a single
reply cannot run the agent's program. `relax-gym check` also runs the agent itself once, against a scripted
engine (`relax_gym.rollout.agent_check`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from relax_gym.env.core import Env, EpisodeState, StepResult
from relax_gym.messages import Message, message
from relax_gym.rewards import RewardResult

Agent = Callable[[Any, Any], Awaitable["float | RewardResult"]]


class AgentEnv(EpisodeState, Env[list[Message]]):
    """An agent program with its tasks (see the module docstring)."""

    def __init__(self, agent: Agent, tasks: Sequence[Any] | Callable[[np.random.Generator], Any]):
        """`tasks`: a list (a seed picks one) or a function of a numpy `Generator` drawing one."""
        if not callable(agent):
            raise TypeError(f"agent must be an async function (client, task) -> reward, got {type(agent).__name__}")
        if not callable(tasks) and not (isinstance(tasks, Sequence) and len(tasks) > 0):
            raise ValueError("tasks must be a non-empty list or a function of a numpy Generator")
        self.agent = agent
        self.tasks = tasks
        self.episode: dict[str, Any] = {}

    def draw_task(self, seed: int | None) -> Any:
        """The task a seed names (the same draw as `reset`'s)."""
        super().reset(seed=seed)
        if callable(self.tasks):
            return self.tasks(self.np_random)
        return self.tasks[int(self.np_random.integers(len(self.tasks)))]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[list[Message], dict]:
        task = self.draw_task(seed)
        self.episode = {"task": task, "done": False}
        return [message("user", task_text(task))], {"task": task_text(task)}

    def step(self, action: str) -> StepResult:
        self.running_episode()["done"] = True
        return [], 0.0, True, False, {"note": "an agent episode runs under the rollout manager, through its proxy"}


def task_text(task: Any) -> str:
    """A task as text: its `prompt` (or `question`) when it is a dict, else itself."""
    if isinstance(task, dict):
        return str(task.get("prompt") or task.get("question") or task)
    return str(task)
