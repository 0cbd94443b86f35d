"""`SingleTurnEnv`: one prompt, one graded answer.

A subclass says what to ask and how to grade through four hooks, the same ones
a `ToolEnv` (a single-turn env whose turns may call tools) uses:

- `new_task(rng, options)`: the next task, drawn from `rng` only;
- `prompt_messages(task)`: the opening messages (by default the system prompt, then `task["prompt"]`);
- `grade(task, answer)`: the final answer's reward, a float or a `RewardResult`;
- `task_info(task)`: JSON-serialisable facts for every `info`.

Reset, step, the reward record in `info`, the reset-before-step guard and
state snapshots (the `EpisodeState` dict `self.episode`) live here once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from relax_gym.env.core import Env, EpisodeState, StepResult
from relax_gym.env.spaces import MessageSpace
from relax_gym.messages import Message, Part, message
from relax_gym.rewards import RewardResult


class SingleTurnEnv(EpisodeState, Env[list[Message]]):
    """Base for envs that pose a task and grade one answer; `self.episode` holds `task` and `done`."""

    metadata: dict[str, Any] = {**Env.metadata}  # noqa: RUF012 (see Env.metadata)
    system_prompt: str | None = None

    def __init__(self) -> None:
        self.observation_space = MessageSpace(modalities=tuple(self.metadata.get("modalities", ("text",))))
        self.episode: dict[str, Any] = {}

    # --- what a subclass provides -------------------------------------------------
    def new_task(self, rng: np.random.Generator, options: dict[str, Any]) -> Any:
        """The next task, drawn from `rng` only (or chosen by `options`, e.g. an index)."""
        raise NotImplementedError

    def prompt_messages(self, task: Any) -> list[Message]:
        """By default the system prompt, then `task["prompt"]` (a string or a list of parts)."""
        prompt = task["prompt"]
        parts: list[Part | str] = [prompt] if isinstance(prompt, str) else list(prompt)
        head = [message("system", self.system_prompt)] if self.system_prompt else []
        return [*head, message("user", *parts)]

    def grade(self, task: Any, answer: str) -> RewardResult | float:
        """The reward of the final answer (a tool env passes its content, without reasoning or tool-call markup)."""
        raise NotImplementedError

    def task_info(self, task: Any) -> dict[str, Any]:
        """JSON-serialisable facts for every `info`; called with `self.episode` already in place."""
        return {}

    # --- the episode ----------------------------------------------------------------
    @property
    def task(self) -> Any:
        """The running episode's task (None before the first reset)."""
        return getattr(self, "episode", {}).get("task")

    @task.setter
    def task(self, task: Any) -> None:
        self.episode["task"] = task

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        task = self.new_task(self.np_random, dict(options or {}))
        observation = self.prompt_messages(task)  # built first: a task that cannot be shown starts no episode
        self.episode = self._start_episode(task)
        return observation, self._info()

    def step(self, action: str) -> StepResult:
        self.running_episode()
        return self._finish(action)

    def _start_episode(self, task: Any) -> dict[str, Any]:
        """The fresh `self.episode`; a subclass adds the counters its loop keeps."""
        return {"task": task, "done": False}

    def _finish(self, answer: str) -> StepResult:
        """Ends the episode (before grading, so a grader that raises still ends it) and returns the graded step."""
        episode = self.episode
        episode["done"] = True
        result = self.grade(episode["task"], answer)
        if not isinstance(result, RewardResult):
            result = RewardResult(score=float(result))
        return [], float(result.score), True, False, self._info(reward=result.to_info())

    def _info(self, **extra: Any) -> dict[str, Any]:
        return {**self.task_info(self.episode["task"]), **extra}
