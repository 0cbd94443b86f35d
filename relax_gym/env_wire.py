"""Moved to relax_gym.env.env_wire; this path re-exports it for one release."""

from relax_gym.env.env_wire import messages_from_json, messages_to_json, plain

__all__ = ["messages_from_json", "messages_to_json", "plain"]
