"""Env ids: register, make, spec, list.

Ids follow gymnasium's grammar (`namespace/Name-vN`) and every id is also put in
gymnasium's own registry, so `gymnasium.make(id)` gives the same env wrapped in
gymnasium's usual checkers. `relax_gym.make` returns the unwrapped env, since
the rollout manager needs `format_observation` and the async methods, which
gymnasium's wrappers no longer forward.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import inspect
import logging
from collections.abc import Callable
from typing import Any

import gymnasium
from gymnasium.envs.registration import EnvSpec, load_env_creator, parse_env_id

from relax_gym.core import Env
from relax_gym.tools import TOOL_MARK

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "relax_gym.envs"

registry: dict[str, EnvSpec] = {}
_plugins_loaded = False


class UnknownEnvError(gymnasium.error.Error, LookupError):
    """No env is registered under the requested id."""


class EnvArgumentError(gymnasium.error.Error, TypeError):
    """An env was made with a keyword its constructor does not take."""


def register(
    id: str,
    entry_point: str | Callable[..., Env],
    *,
    max_episode_steps: int | None = None,
    nondeterministic: bool = False,
    **kwargs: Any,
) -> EnvSpec:
    """Registers `entry_point` (a class, factory or "module:attr") under `id`; `kwargs` are defaults."""
    parse_env_id(id)  # raises gymnasium's error naming the malformed part
    if id in registry:
        logger.warning("re-registering %s: the new entry point replaces the old one", id)
    spec = EnvSpec(
        id=id,
        entry_point=entry_point,
        max_episode_steps=max_episode_steps,
        nondeterministic=nondeterministic,
        kwargs=dict(kwargs),
    )
    registry[id] = spec
    gymnasium.registry[id] = spec
    return spec


def _load_plugins() -> None:
    """Registers the bundled envs, then those of third-party packages' entry points."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    import relax_gym.envs  # noqa: F401  (registers the bundled ids)

    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.value.startswith("relax_gym.envs"):
            continue
        try:
            loaded = ep.load()
            if callable(loaded):
                loaded()
        except Exception as err:  # one broken plugin must not hide every other env
            logger.warning("could not load env plugin %s (%s): %s", ep.name, ep.value, err)


def spec(id: str) -> EnvSpec:
    """The registration of `id`; an unknown id names the closest registered ones."""
    _load_plugins()
    found = registry.get(id)
    if found is None:
        close = difflib.get_close_matches(id, list(registry), n=3, cutoff=0.5)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownEnvError(f"no env registered as {id!r}.{hint} `relax-gym envs` lists them all.")
    return found


def list_envs() -> list[str]:
    _load_plugins()
    return sorted(registry)


def env_class(id: str) -> Callable[..., Env]:
    entry = spec(id).entry_point
    return load_env_creator(entry) if isinstance(entry, str) else entry  # type: ignore[return-value]


def _check_kwargs(id: str, creator: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    target = creator.__init__ if inspect.isclass(creator) else creator
    params = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if n != "self" and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    for key in kwargs:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise EnvArgumentError(
                f"{id} got an unexpected argument {key!r}.{hint} Valid arguments: {', '.join(valid) or 'none'}"
            )


def make(id: str, **kwargs: Any) -> Env:
    """Creates the env registered as `id`; `kwargs` override the registered defaults."""
    env_spec = spec(id)
    creator = env_class(id)
    merged = {**env_spec.kwargs, **kwargs}
    _check_kwargs(id, creator, merged)
    env = creator(**merged)
    env.unwrapped.spec = dataclasses.replace(env_spec, kwargs=merged)
    return env


def describe(id: str) -> dict[str, Any]:
    """Modalities, tools and sandbox use declared by the env class, without creating it."""
    cls = env_class(id)
    meta = getattr(cls, "metadata", {}) or {}
    tools = tuple(meta.get("tools") or ())
    if not tools and inspect.isclass(cls):
        tools = tuple(n for n in dir(cls) if getattr(getattr(cls, n, None), TOOL_MARK, False))
    entry = spec(id).entry_point
    return {
        "id": id,
        "modalities": list(meta.get("modalities", ("text",))),
        "tools": list(tools),
        "sandbox": bool(meta.get("sandbox", False)),
        "entry_point": entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}",
        "description": (inspect.getdoc(cls) or "").split("\n")[0],
    }
