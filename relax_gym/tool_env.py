"""`ToolEnv`: a multi-turn env where the model calls tools, then answers.

A subclass provides `new_task` (what to ask), `score` (how to grade the final
answer) and its tools as `@tool` methods; the turn loop, tool-call parsing,
error observations, turn limits and state snapshots live here once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from relax_gym.core import Env, EpisodeOverError, EpisodeState, StepResult
from relax_gym.messages import Message, Part, message, text
from relax_gym.rewards import RewardResult
from relax_gym.spaces import MessageSpace
from relax_gym.tools import TOOL_MARK, ToolSet, parse_tool_calls


class ToolEnv(EpisodeState, Env[list[Message]]):
    """Base for tool-using envs. Episode state lives in `self.episode` so snapshots are automatic."""

    metadata: ClassVar[dict[str, Any]] = {**Env.metadata}
    max_turns: int = 6
    system_prompt: str | None = None

    def __init__(self, *, max_turns: int | None = None):
        if max_turns is not None:
            if max_turns < 1:
                raise ValueError(f"max_turns must be >= 1, got {max_turns}")
            self.max_turns = max_turns
        self.toolset = ToolSet(self.make_tools())
        self.metadata = {**type(self).metadata, "tools": self.toolset.names}
        modalities = tuple(self.metadata.get("modalities", ("text",)))
        self.observation_space = MessageSpace(modalities=modalities)
        self.episode: dict[str, Any] = {}

    # --- what a subclass provides -------------------------------------------------
    def new_task(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        """A task dict with at least `prompt` (str or list of parts); drawn from `rng` only."""
        raise NotImplementedError

    def score(self, answer: str) -> RewardResult | float:
        """Grades the final (tool-call-free) answer against `self.episode["task"]`."""
        raise NotImplementedError

    def make_tools(self) -> list[Callable[..., Any]]:
        """The tools to offer: by default every method marked with `@tool`."""
        cls = type(self)
        return [getattr(self, n) for n in dir(cls) if getattr(getattr(cls, n, None), TOOL_MARK, False)]

    def prompt_messages(self) -> list[Message]:
        prompt = self.episode["task"]["prompt"]
        parts: list[Part | str] = [prompt] if isinstance(prompt, str) else list(prompt)
        msgs = [message("system", self.system_prompt)] if self.system_prompt else []
        return [*msgs, message("user", *parts)]

    # --- the loop -----------------------------------------------------------------
    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.toolset.schemas

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        task = self.new_task(self.np_random, dict(options or {}))
        self.episode = {"task": task, "turn": 0, "tool_calls": 0, "tool_successes": 0, "tool_errors": 0, "done": False}
        return self.prompt_messages(), self._info()

    def step(self, action: str) -> StepResult:
        ep = self.episode
        if not ep or ep["done"]:
            raise EpisodeOverError("call reset() before step(); the episode has not started or is over")
        ep["turn"] += 1
        parsed = parse_tool_calls(action)
        if not parsed.has_tool_calls:
            ep["done"] = True
            result = self.score(parsed.content)
            if not isinstance(result, RewardResult):
                result = RewardResult(score=float(result), status="ok")
            return [], float(result.score), True, False, self._info(reward=result.to_info())
        observation: list[Message] = []
        for err in parsed.errors:
            ep["tool_errors"] += 1
            observation.append(message("tool", text(f"Error: {err.message}"), name="tool_call_parser"))
        for call in parsed.calls:
            ep["tool_calls"] += 1
            outcome = self.toolset.execute(call)
            ep["tool_errors"] += outcome.is_error
            ep["tool_successes"] += not outcome.is_error
            observation.append(message("tool", *outcome.content, name=call.name))
        if ep["turn"] >= self.max_turns:
            ep["done"] = True
            return observation, 0.0, False, True, self._info(truncated_by="max_turns")
        return observation, 0.0, False, False, self._info()

    def episode_info(self) -> dict[str, Any]:
        """JSON-serialisable facts about the running episode for every `info` (a subclass adds its own)."""
        return {}

    def _info(self, **extra: Any) -> dict[str, Any]:
        ep = self.episode
        counts = {k: ep[k] for k in ("turn", "tool_calls", "tool_successes", "tool_errors")}
        return {**counts, **self.episode_info(), **extra}
