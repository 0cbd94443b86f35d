"""The LoRA adapters a run has pushed to a server that loads them by name (SGLang's and vLLM's runtime LoRA routes):
which name each push loads under, which name a request runs on, and which loaded ones to unload.

A push of version v from the folder `run/weights/v{v}` is loaded as `relax-gym-{run}-v{v}`, `{run}` a digest of
the folder it sits in: two runs on one server never share a name, and a resumed run pushes under its own names
again. Every later request names the newest and keeps it to its end whatever is pushed meanwhile, so all of a
request's tokens have that adapter's version. The newest `keep` stay loaded: a run keeps `max_staleness + 1`, so
a request of the oldest version it may still train on finishes on its own adapter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PushedAdapters", "adapter_name"]


def adapter_name(folder: str | Path, version: int) -> str:
    """The name the adapter folder `folder` of `version` is loaded under."""
    run = hashlib.blake2b(str(Path(folder).resolve().parent).encode(), digest_size=4).hexdigest()
    return f"relax-gym-{run}-v{version}"


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

    def pushed(self, name: str, version: int) -> list[str]:
        """Records that `name` of `version` is loaded (a name loaded again, after a resume, moves to the end);
        returns the names now past `keep`, to unload, oldest first."""
        self.loaded = [(n, v) for n, v in self.loaded if n != name] + [(name, version)]
        stale = self.loaded[: max(0, len(self.loaded) - self.keep)]
        self.loaded = self.loaded[len(stale):]
        return [n for n, _ in stale]
