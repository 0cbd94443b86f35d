"""Moved to relax_gym.env.core; this path re-exports it for one release."""

from relax_gym.env.core import Env, EpisodeOverError, EpisodeState, ObsT, StepResult

__all__ = ["Env", "EpisodeOverError", "EpisodeState", "ObsT", "StepResult"]
