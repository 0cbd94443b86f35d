"""`make_engine`: the engine a run's settings name (an SGLang client or the embedded engine).

It takes the settings as a small protocol (`EngineSettings`, which the training config's `rollout:`
section satisfies), so building an engine needs nothing from the trainer package.
"""

from __future__ import annotations

from typing import Any, Protocol

from relax_gym.engines.base import Engine


class EngineSettings(Protocol):
    """What `make_engine` reads: the `rollout.engine*` settings."""

    @property
    def engine(self) -> str: ...  # "embedded" or "sglang"

    @property
    def engine_url(self) -> str | None: ...

    @property
    def engine_outage_timeout_s(self) -> float: ...

    @property
    def engine_max_batch_size(self) -> int: ...


def make_engine(loaded: Any, settings: EngineSettings, *, seed: int = 0) -> Engine:
    """The engine `settings.engine` names: an SGLang client (an unlimited connection pool: the run's concurrency
    is the cap), or the embedded engine over `loaded`."""
    if settings.engine == "sglang" and settings.engine_url:
        from relax_gym.engines.sglang import SGLangEngine

        return SGLangEngine(settings.engine_url, outage_timeout_s=settings.engine_outage_timeout_s,
                            max_connections=None)
    from relax_gym.engines.embedded import EmbeddedEngine

    return EmbeddedEngine(loaded, max_batch_size=settings.engine_max_batch_size, seed=seed)
