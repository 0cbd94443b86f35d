"""The environment base class.

`Env` is a `gymnasium.Env` whose actions are the assistant's text for one turn
and whose observations render to chat messages, so gymnasium's `check_env`,
wrappers and registry apply unchanged, and the rollout manager only needs
`format_observation` to turn any observation into tokens.
"""

from __future__ import annotations

import asyncio
import copy
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, cast

import gymnasium as gym
import numpy as np

from relax_gym.env.spaces import ActionText, MessageSpace
from relax_gym.messages import Message, validate_messages
from relax_gym.tools.function_tool import TOOL_MARK

ObsT = TypeVar("ObsT")

StepResult = tuple[Any, float, bool, bool, dict[str, Any]]


class EpisodeOverError(RuntimeError):
    """`step` was called before `reset` or after the episode ended."""


class Env(gym.Env[ObsT, str], Generic[ObsT]):
    """A multi-turn chat environment.

    Subclasses implement `reset` and `step` like any gymnasium env (call
    `super().reset(seed=seed)` first to seed `self.np_random`). By default an
    observation *is* a list of new chat messages; an env with another
    observation type overrides `format_observation` to render it.

    `metadata` keys read by relax_gym:
      - `modalities`: content types the env emits (`text`, `image`, `audio`);
      - `tools`: names of the tools offered to the model;
      - `sandbox`: whether the env executes code in the sandbox.
    """

    #: not a ClassVar: gymnasium declares it an instance attribute, and an instance may refine it (ToolEnv adds the
    #: names of its tools); subclasses replace the dict rather than mutate it
    metadata: dict[str, Any] = {  # noqa: RUF012
        "render_modes": [],
        "modalities": ("text",),
        "tools": (),
        "sandbox": False,
    }

    observation_space: gym.spaces.Space = MessageSpace()
    action_space: gym.spaces.Space = ActionText()

    #: False for envs whose reset/step take microseconds (pure Python, no I/O): the default async
    #: methods then call them on the event loop, since a worker-thread hop costs more than the step
    blocking: ClassVar[bool] = True

    #: names of the class's `@tool`-marked methods, collected once when the class is defined, so
    #: `ToolEnv.make_tools` and `relax_gym.describe` need not scan the class each time
    tool_names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.tool_names = tuple(n for n in dir(cls) if getattr(getattr(cls, n, None), TOOL_MARK, False))

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """Tool schemas offered through the chat template's `tools=` (see relax_gym.tools)."""
        return []

    def format_observation(self, observation: ObsT) -> list[Message]:
        """Renders an observation as the chat messages to append to the conversation."""
        validate_messages(observation)
        return copy.copy(cast("list[Message]", observation))  # the check above: it is a list of messages

    if TYPE_CHECKING:  # gymnasium's reward is any SupportsFloat; a relax_gym env's is a float
        def step(self, action: str) -> StepResult: ...

    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[ObsT, dict]:
        """Async reset; by default `reset` runs in a worker thread so a slow env never blocks the loop."""
        if not self.blocking:
            return self.reset(seed=seed, options=options)
        return await asyncio.to_thread(self.reset, seed=seed, options=options)

    async def astep(self, action: str) -> StepResult:
        """Async step; override for envs that wait on I/O (a judge model, a sandbox)."""
        if not self.blocking:
            return self.step(action)
        return await asyncio.to_thread(self.step, action)

    def get_state(self) -> dict[str, Any]:
        """A picklable snapshot from which `set_state` resumes the episode (optional)."""
        raise NotImplementedError(f"{type(self).__name__} does not support get_state/set_state")

    def set_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support get_state/set_state")

    @property
    def supports_state(self) -> bool:
        """True when the subclass overrides both state methods."""
        cls = type(self)
        return cls.get_state is not Env.get_state and cls.set_state is not Env.set_state


class EpisodeState:
    """Mixin for envs that keep everything about the running episode in `self.episode`.

    A snapshot is that dict plus the env's RNG state, so `set_state` resumes
    exactly, random draws included. `self.episode["done"]` marks an episode
    over; `running_episode` is the one reset-before-step guard every env shares.
    """

    episode: dict[str, Any]
    if TYPE_CHECKING:  # gymnasium.Env's, which every class using this mixin also subclasses
        np_random: np.random.Generator
        _np_random: np.random.Generator | None

    def running_episode(self) -> dict[str, Any]:
        """`self.episode`, or EpisodeOverError before the first reset or once the episode is done.

        Called first thing in `step`, so stepping a finished episode fails loudly
        instead of grading or advancing it again.
        """
        episode = getattr(self, "episode", None)
        if not episode or episode.get("done", True):
            raise EpisodeOverError("call reset() before step(); the episode has not started or is over")
        return episode

    def get_state(self) -> dict[str, Any]:
        return {"episode": copy.deepcopy(self.episode), "rng": copy.deepcopy(self.np_random.bit_generator.state)}

    def set_state(self, state: dict[str, Any]) -> None:
        self.episode = copy.deepcopy(state["episode"])
        rng = np.random.default_rng()
        rng.bit_generator.state = copy.deepcopy(state["rng"])
        self._np_random = rng
