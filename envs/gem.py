"""Any GEM env (https://github.com/axon-rl/gem) by its GEM id, e.g. `game:GuessTheNumber-v0-easy`.

GEM's games are multi-turn text envs with per-step rewards; wrapping them by id
gives all of them without a copy here. GEM draws everything from the
process-wide `random` and `numpy.random` RNGs (its `reset(seed)` seeds them), so
each env keeps its own copy of those states and swaps it in, under one lock,
for every GEM call: a seed then names the whole episode however many envs run in
threads, and the process's own RNGs never move. It is an optional extra,
imported when the env is made, not when the id is listed.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import logging
import random
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import numpy as np

from relax_gym.env.core import Env, EpisodeState, StepResult
from relax_gym.env.env_wire import plain
from relax_gym.env.spaces import MessageSpace
from relax_gym.messages import Message, message

INSTALL_HINT = "pip install 'relax-gym[gem]'"
TERMINAL_STATE = "<｜TERMINAL_STATE｜>"  # GEM's placeholder observation for "nothing more to say"
SCRIPTED_TURNS = 8

#: GEM's calls seed and draw from the process-wide RNGs, so at most one runs at a time
_LOCK = threading.RLock()
T = TypeVar("T")
RngStates = tuple[Any, Any]  # (random.getstate(), np.random.get_state())


def import_gem() -> ModuleType:
    """`import gem`, undoing its side effects: `logging.basicConfig(level=INFO)` on the root logger, and the draws
    its imports (reasoning-gym's) make from the process-wide RNGs."""
    root = logging.getLogger()
    with _LOCK:
        level, handlers = root.level, root.handlers[:]
        try:
            return isolated(lambda: importlib.import_module("gem"))[0]
        except ImportError as err:
            raise ImportError(f"relax/GEM-v0 needs the gem-llm package (import name gem): {INSTALL_HINT}") from err
        finally:
            root.setLevel(level)
            root.handlers[:] = handlers


def isolated(call: Callable[[], T], rngs: RngStates | None = None) -> tuple[T, RngStates]:
    """Runs `call` with `rngs` (None: a fixed throwaway state) in the process-wide RNGs, under the lock; returns its
    result and the RNG states it left, and puts the process's own states back."""
    with _LOCK:
        saved = random.getstate(), np.random.get_state()
        try:
            if rngs is None:
                random.seed(0)
                np.random.seed(0)
            else:
                random.setstate(rngs[0])
                np.random.set_state(rngs[1])
            result = call()
            return result, (random.getstate(), np.random.get_state())
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])


def make_gem(gem_id: str, kwargs: dict[str, Any]) -> Any:
    """`gem.make(gem_id, **kwargs)`; an unknown id is one line naming GEM's closest ids."""
    gem = import_gem()
    registry = gem.envs.registration.ENV_REGISTRY
    if gem_id not in registry:
        by_lower = {k.lower(): k for k in registry}
        close = [by_lower[k] for k in difflib.get_close_matches(gem_id.lower(), list(by_lower), n=5, cutoff=0.5)]
        hint = f"close matches: {', '.join(close)}" if close else f"gem.print_envs() lists its {len(registry)} ids"
        raise ValueError(f"GEM has no env {gem_id!r}; {hint}")
    return isolated(lambda: gem.make(gem_id, **kwargs))[0]  # some games reset (and draw) in __init__


class GemEnv(EpisodeState, Env[list[Message]]):
    """A GEM env by id; each observation is a user message, the reply is the action, GEM's step rewards as given.

    Extra kwargs go to `gem.make` (e.g. `max_turns=5`). The seed given to `reset` is GEM's seed, so
    `reset(seed=s)` poses the task `gem.make(gem_id).reset(seed=s)` does.
    """

    metadata: dict[str, Any] = {**Env.metadata, "modalities": ("text",)}  # noqa: RUF012 (see Env.metadata)

    def __init__(self, gem_id: str = "game:GuessTheNumber-v0-easy", **kwargs: Any):
        self.gem_id = gem_id
        self.game = make_gem(gem_id, kwargs)
        self.observation_space = MessageSpace(modalities=self.metadata["modalities"])
        self.episode: dict[str, Any] = {}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Seeds GEM with `seed` (without one, a seed drawn from this env's own RNG)."""
        super().reset(seed=seed)
        gem_seed = seed if seed is not None else int(self.np_random.integers(2**31))
        (text, info), rngs = isolated(lambda: self.game.reset(seed=gem_seed))
        self.episode = {"turn": 0, "done": False, "rngs": rngs, "gem_seed": gem_seed}
        return self._messages(text, info), self._info(info)

    def step(self, action: str) -> StepResult:
        episode = self.running_episode()
        episode["turn"] += 1
        episode["done"] = True  # until GEM returns: a step that raises ends the episode
        (text, reward, terminated, truncated, info), episode["rngs"] = isolated(
            lambda: self.game.step(action), episode["rngs"])
        # GEM reports a game over by its own rule (its turn limit, a single-turn task) as terminated *and* truncated;
        # in gymnasium's terms that is terminated, and truncated only when the game did not end it
        terminated, truncated = bool(terminated), bool(truncated) and not terminated
        episode["done"] = terminated or truncated
        # the last observation is not shown to the model; it keeps GEM's verdict, without "Enter your next guess."
        observation = [] if text == TERMINAL_STATE else self._messages(text, {} if episode["done"] else info)
        return observation, float(reward), terminated, truncated, self._info(info)

    def scripted_actions(self) -> list[str]:
        """The `ScriptedEnv` hook (`relax-gym check`): GEM's own `sample_random_action()` for a few turns, drawn
        from a copy of the episode's RNGs so the episode is unchanged; [] for a game without one."""
        rngs = self.episode.get("rngs")
        if rngs is None:
            return []

        def draw() -> list[str]:
            return [str(self.game.sample_random_action()) for _ in range(SCRIPTED_TURNS)]

        try:
            return isolated(draw, copy.deepcopy(rngs))[0]
        except NotImplementedError:
            return []

    def get_state(self) -> dict[str, Any]:
        """The episode, its RNG states and a copy of the GEM env object (its attributes are the game's state)."""
        return {**super().get_state(), "game": copy.deepcopy(self.game)}

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self.game = copy.deepcopy(state["game"])

    def _messages(self, text: Any, info: dict[str, Any]) -> list[Message]:
        """GEM's observation as one user message, framed by its info's `prefix`/`suffix` as GEM's wrappers do."""
        body = str(text)
        if body and info.get("suffix") and not body.endswith("\n"):
            body += "\n"
        body = f"{info.get('prefix', '')}{body}{info.get('suffix', '')}"
        return [message("user", body)] if body else []

    def _info(self, info: dict[str, Any]) -> dict[str, Any]:
        return {"gem_id": self.gem_id, "turn": self.episode["turn"], "gem_seed": self.episode["gem_seed"],
                "gem_info": plain(info)}
