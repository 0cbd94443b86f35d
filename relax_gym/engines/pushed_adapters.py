"""The LoRA adapters a run has pushed to a server that loads them by name (SGLang's and vLLM's runtime LoRA routes):
which name each push loads under, which name a request runs on, and which loaded ones to unload.

Every push is loaded as `relax-gym-v{version}` and every later request names the newest, keeping it to its end
whatever is pushed meanwhile, so all of a request's tokens have that adapter's version. The newest `keep` stay
loaded: a run keeps `max_staleness + 1`, so a request of the oldest version it may still train on finishes on its
own adapter.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["ADAPTER_NAME", "PushedAdapters"]

#: the name a pushed adapter of version v is loaded under
ADAPTER_NAME = "relax-gym-v{version}"


class PushedAdapters:
    """The loaded adapters, oldest first, as (name, version)."""

    def __init__(self, keep: int) -> None:
        self.keep = max(1, keep)
        self.loaded: list[tuple[str, int]] = []

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(list(self.loaded))

    @property
    def newest(self) -> tuple[str, int] | None:
        """The adapter a request starting now runs on, or None before the first push."""
        return self.loaded[-1] if self.loaded else None

    def pushed(self, version: int) -> tuple[str, list[str]]:
        """Records the push of `version` (a version pushed again, after a resume, moves to the end): its name, and
        the names now past `keep`, to unload, oldest first."""
        name = ADAPTER_NAME.format(version=version)
        self.loaded = [(n, v) for n, v in self.loaded if n != name] + [(name, version)]
        stale = self.loaded[: max(0, len(self.loaded) - self.keep)]
        self.loaded = self.loaded[len(stale):]
        return name, [n for n, _ in stale]
