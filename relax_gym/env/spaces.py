"""Gymnasium spaces for chat environments.

Actions are the decoded assistant text of one turn, so any Unicode string is a
valid action (gymnasium's `Text` only admits its sampling charset). Observations
of the bundled envs are lists of chat messages, validated part by part.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from typing import Any, cast

from gymnasium import spaces

from relax_gym.messages import PART_TYPES, ROLES, Message, MessageError, Role, text, validate_messages

# Sampling alphabet: printable ASCII including the characters tool calls and
# LaTeX are made of, so random actions probe the parsers, not just letters.
ACTION_CHARSET = string.ascii_letters + string.digits + string.punctuation + " \n"


class ActionText(spaces.Text):
    """Any string up to `max_length` characters; samples from printable ASCII."""

    def __init__(self, max_length: int = 8192, *, min_length: int = 0, seed: int | None = None):
        super().__init__(max_length=max_length, min_length=min_length, charset=ACTION_CHARSET, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"ActionText(max_length={self.max_length})"


class MessageSpace(spaces.Space[list[Message]]):
    """Lists of chat messages whose roles and content-part types are allowed.

    `contains` runs the full part validation (PIL images, 1-D float waveforms
    with a sample rate), so an env that returns a malformed message fails
    `check_env` instead of failing later inside a chat template.
    """

    def __init__(
        self,
        modalities: Iterable[str] = ("text",),
        roles: Iterable[str] = ("system", "user", "tool"),
        max_messages: int = 64,
        seed: int | None = None,
    ):
        self.modalities = tuple(modalities)
        self.roles = tuple(roles)
        bad = [m for m in self.modalities if m not in PART_TYPES] + [r for r in self.roles if r not in ROLES]
        if bad:
            raise ValueError(f"unknown modalities/roles {bad}; modalities are {PART_TYPES}, roles {ROLES}")
        self.max_messages = max_messages
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def explain(self, x: Any) -> str | None:
        """Why `x` is not in the space, or None when it is."""
        try:
            validate_messages(x)
        except MessageError as err:
            return str(err)
        if len(x) > self.max_messages:  # zero is fine: a terminal step may add no messages
            return f"expected at most {self.max_messages} messages, got {len(x)}"
        for i, msg in enumerate(x):
            if msg["role"] not in self.roles:
                return f"messages[{i}]: role {msg['role']!r} not allowed here (allowed: {self.roles})"
            for j, part in enumerate(msg["content"]):
                if part["type"] not in self.modalities:
                    return (
                        f"messages[{i}].content[{j}]: {part['type']!r} part but the env declares "
                        f"modalities {self.modalities}"
                    )
        return None

    def contains(self, x: Any) -> bool:
        return self.explain(x) is None

    def sample(self, mask: Any = None, probability: Any = None) -> list[Message]:
        if mask is not None or probability is not None:
            raise NotImplementedError("MessageSpace.sample takes no mask or probability")
        rng = self.np_random
        n = int(rng.integers(1, 12))
        words = "".join(rng.choice(list(string.ascii_lowercase + " "), size=n * 4))
        role = cast("Role", "user" if "user" in self.roles else self.roles[0])  # __init__ checked it is a role
        return [{"role": role, "content": [text(words)]}]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, MessageSpace)
            and other.modalities == self.modalities
            and other.roles == self.roles
            and other.max_messages == self.max_messages
        )

    def __repr__(self) -> str:
        return f"MessageSpace(modalities={self.modalities}, roles={self.roles})"

