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
import re
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from relax_gym.engines.base import RequestError

__all__ = ["KEEP_ADAPTERS", "PushedAdapters", "adapter_name"]

#: adapters kept loaded where no run says (a run: `max_staleness + 1`, its default 1 + 1)
KEEP_ADAPTERS = 2
#: how SGLang ("... because it is already loaded") and vLLM ("... has already been loaded") refuse a name they hold
ALREADY_LOADED = re.compile(r"already (been )?loaded")


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

    async def load(self, request: Callable[[str, str, dict[str, Any]], Awaitable[Any]], folder: Path, version: int,
                   *, load_route: str, unload_route: str) -> None:
        """Loads the adapter folder of `version` under its name through the client's `request` and the server's
        `load_route` (a name the server still holds, from before a resume, is unloaded and loaded again), then
        unloads the loaded ones past `keep`, oldest first. Both servers take the same bodies."""
        name = adapter_name(folder, version)
        payload = {"lora_name": name, "lora_path": str(folder)}
        try:
            await request("POST", load_route, payload)
        except RequestError as err:
            if not ALREADY_LOADED.search(str(err)):
                raise
            await request("POST", unload_route, {"lora_name": name})
            await request("POST", load_route, payload)
        for old in self.note(folder, version):
            await request("POST", unload_route, {"lora_name": old})

    def note(self, folder: Path, version: int) -> list[str]:
        """Records that the adapter folder of `version` is loaded under its name, by `load` or by another client of
        the same server (a cluster's engine fleet loads it; its rollout workers' clients note it, so their requests
        name it); returns the names past `keep`, oldest first, which requests no longer name."""
        name = adapter_name(folder, version)
        self.loaded = [(n, v) for n, v in self.loaded if n != name] + [(name, version)]
        stale, self.loaded = self.loaded[: max(0, len(self.loaded) - self.keep)], self.loaded[-self.keep:]
        return [n for n, _ in stale]
