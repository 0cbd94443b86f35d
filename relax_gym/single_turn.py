"""`SingleTurnEnv`: one prompt, one graded answer.

A subclass says what to ask (`new_task`, optionally `prompt_messages`) and how
to grade (`grade`); reset, step, the reward record in `info` and state
snapshots live here once, as the turn loop does in `ToolEnv`.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import numpy as np

from relax_gym.core import Env, EpisodeOverError, StepResult
from relax_gym.messages import Message, Part, message
from relax_gym.rewards import RewardResult
from relax_gym.spaces import MessageSpace


class SingleTurnEnv(Env[list[Message]]):
    metadata: ClassVar[dict[str, Any]] = {**Env.metadata}
    system_prompt: str | None = None

    def __init__(self) -> None:
        self.observation_space = MessageSpace(modalities=tuple(self.metadata.get("modalities", ("text",))))
        self.task: Any = None
        self.done = True

    # --- what a subclass provides -------------------------------------------------
    def new_task(self, rng: np.random.Generator, options: dict[str, Any]) -> Any:
        """The next task, drawn from `rng` only (or chosen by `options`, e.g. an index)."""
        raise NotImplementedError

    def grade(self, task: Any, answer: str) -> RewardResult | float:
        raise NotImplementedError

    def prompt_messages(self, task: Any) -> list[Message]:
        """By default the system prompt, then `task["prompt"]` (a string or a list of parts)."""
        prompt = task["prompt"]
        parts: list[Part | str] = [prompt] if isinstance(prompt, str) else list(prompt)
        head = [message("system", self.system_prompt)] if self.system_prompt else []
        return [*head, message("user", *parts)]

    def task_info(self, task: Any) -> dict[str, Any]:
        """JSON-serialisable facts about the task for `info` (at reset and at the graded step)."""
        return {}

    # --- the episode ----------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        task = self.new_task(self.np_random, dict(options or {}))
        observation = self.prompt_messages(task)  # built first: a task that cannot be shown starts no episode
        self.task, self.done = task, False
        return observation, self.task_info(task)

    def step(self, action: str) -> StepResult:
        if self.task is None or self.done:
            raise EpisodeOverError("call reset() before step(); the episode has not started or is over")
        self.done = True
        result = self.grade(self.task, action)
        if not isinstance(result, RewardResult):
            result = RewardResult(score=float(result))
        return [], float(result.score), True, False, {**self.task_info(self.task), "reward": result.to_info()}

    def get_state(self) -> dict[str, Any]:
        return {"task": copy.deepcopy(self.task), "done": self.done}

    def set_state(self, state: dict[str, Any]) -> None:
        self.task, self.done = copy.deepcopy(state["task"]), bool(state["done"])
