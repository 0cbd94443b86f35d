"""relax_gym: agentic environments for LLMs, VLMs and audio models, with an RL trainer.

`import relax_gym` registers the bundled envs (ids under `relax/`) with both
relax_gym's and gymnasium's registries, by importing `relax_gym.envs`, whose
string entry points load no env module. Third-party plugins (entry-point group
`relax_gym.envs`) load on the first lookup (`make`, `spec`, `list_envs`), so
importing any submodule (the engines, the trainer) runs no env or plugin code.
"""

from typing import TYPE_CHECKING, Any

from relax_gym import envs  # noqa: F401  (registers the bundled ids, once)
from relax_gym.env.core import Env, EpisodeOverError, EpisodeState, StepResult
from relax_gym.env.registration import (
    EnvArgumentError,
    UnknownEnvError,
    describe,
    list_envs,
    make,
    register,
    register_namespace,
    registry,
    spec,
)
from relax_gym.env.single_turn import SingleTurnEnv
from relax_gym.env.tool_env import ToolEnv
from relax_gym.rewards import RewardResult
from relax_gym.tools import Tool, tool
from relax_gym.version import __version__

if TYPE_CHECKING:
    from relax_gym.env.remote_env import RemoteEnv, RemoteEnvError


def __getattr__(name: str) -> Any:
    """`RemoteEnv` and `RemoteEnvError` on first use: importing relax_gym costs no HTTP client."""
    if name in ("RemoteEnv", "RemoteEnvError"):
        from relax_gym.env import remote_env

        return getattr(remote_env, name)
    raise AttributeError(f"module 'relax_gym' has no attribute {name!r}")



__all__ = [
    "Env",
    "EnvArgumentError",
    "EpisodeOverError",
    "EpisodeState",
    "RemoteEnv",
    "RemoteEnvError",
    "RewardResult",
    "SingleTurnEnv",
    "StepResult",
    "Tool",
    "ToolEnv",
    "UnknownEnvError",
    "__version__",
    "describe",
    "list_envs",
    "make",
    "register",
    "register_namespace",
    "registry",
    "spec",
    "tool",
]
