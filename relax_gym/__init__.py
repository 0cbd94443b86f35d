"""relax_gym: agentic environments for LLMs, VLMs and audio models, with an RL trainer.

`import relax_gym` registers the bundled envs (ids under `relax/`) with both
relax_gym's and gymnasium's registries.
"""

from relax_gym.core import Env, EpisodeOverError
from relax_gym.registration import UnknownEnvError, describe, list_envs, make, register, registry, spec
from relax_gym.single_turn import SingleTurnEnv
from relax_gym.tool_env import ToolEnv
from relax_gym.tools import Tool, tool

__version__ = "0.1.0"

__all__ = [
    "Env",
    "EpisodeOverError",
    "SingleTurnEnv",
    "Tool",
    "ToolEnv",
    "UnknownEnvError",
    "describe",
    "list_envs",
    "make",
    "register",
    "registry",
    "spec",
    "tool",
]

from relax_gym.registration import _load_plugins

_load_plugins()
