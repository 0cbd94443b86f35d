"""Moved to relax_gym.env.remote_env; this path re-exports it for one release."""

from relax_gym.env.remote_env import RemoteEnv, RemoteEnvError

__all__ = ["RemoteEnv", "RemoteEnvError"]
