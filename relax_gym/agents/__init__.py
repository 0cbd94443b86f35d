"""Agents written against an OpenAI-style API, trained as envs: `AgentEnv` and the proxy that records them."""

from relax_gym.agents.agent_env import AgentEnv, task_text

__all__ = ["AgentEnv", "task_text"]
