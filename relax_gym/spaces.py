"""Moved to relax_gym.env.spaces; this path re-exports it for one release."""

from relax_gym.env.spaces import ACTION_CHARSET, ActionText, MessageSpace

__all__ = ["ACTION_CHARSET", "ActionText", "MessageSpace"]
