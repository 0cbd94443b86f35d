"""Moved to relax_gym.env.env_server; this path re-exports it for one release."""

from relax_gym.env.env_server import KEY_HINT, EnvSessions, Refused, ResetIn, SessionIn, StepIn, create_app, serve_env

__all__ = ["KEY_HINT", "EnvSessions", "Refused", "ResetIn", "SessionIn", "StepIn", "create_app", "serve_env"]
