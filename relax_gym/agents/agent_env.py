"""Moved to relax_gym.env.agent_env; this path re-exports it for one release."""

from relax_gym.env.agent_env import Agent, AgentEnv, task_text

__all__ = ["Agent", "AgentEnv", "task_text"]
