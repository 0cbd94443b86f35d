"""Moved to relax_gym.env.single_turn; this path re-exports it for one release."""

from relax_gym.env.single_turn import SingleTurnEnv

__all__ = ["SingleTurnEnv"]
