"""Moved to relax_gym.env.tool_env; this path re-exports it for one release."""

from relax_gym.env.tool_env import ToolEnv

__all__ = ["ToolEnv"]
