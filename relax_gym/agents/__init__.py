"""Moved to relax_gym.env.agent_env; this path re-exports `AgentEnv` and `task_text` for one release."""

from relax_gym.env.agent_env import AgentEnv, task_text

__all__ = ["AgentEnv", "task_text"]
