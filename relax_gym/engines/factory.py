"""`make_engine`: the engine a run's settings name (an SGLang or vLLM client, a router over several, or the embedded
engine).

It takes the settings as a small protocol (`EngineSettings`, which the training config's `rollout:`
section satisfies), so building an engine needs nothing from the trainer package.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from relax_gym.engines.base import Engine
from relax_gym.engines.pushed_adapters import KEEP_ADAPTERS
from relax_gym.engines.router import MEMBER_OUTAGE_TIMEOUT_S, MEMBER_RETRIES

if TYPE_CHECKING:  # the embedded engine (and torch) is imported only when it is the one made
    from relax_gym.cpu.threads import ThreadPlacement
    from relax_gym.engines.embedded import Batching


class EngineSettings(Protocol):
    """What `make_engine` reads: the `rollout.engine*` settings."""

    @property
    def engine(self) -> str: ...  # "embedded", "sglang" or "vllm"

    @property
    def engine_url(self) -> str | None: ...

    @property
    def engine_urls(self) -> Sequence[str] | None: ...

    @property
    def engine_outage_timeout_s(self) -> float: ...

    @property
    def engine_max_batch_size(self) -> int: ...

    @property
    def engine_batching(self) -> Batching: ...

    @property
    def engine_device(self) -> str: ...

    @property
    def engine_dtype(self) -> str: ...  # "auto", "float32" or "bfloat16"

    @property
    def max_total_tokens(self) -> int: ...  # an episode's tokens: the context a started vLLM server is given


def make_engine(loaded: Any, settings: EngineSettings, *, seed: int = 0,
                placement: ThreadPlacement | None = None, lora: tuple[int, int] | None = None) -> Engine:
    """The engine `settings.engine` names: a vLLM client (`vllm.vllm_engine`: of `engine_url(s)`, or of a server it
    starts on `loaded`), an SGLang client (an unlimited connection pool: the run's concurrency
    is the cap), an `EngineRouter` over one client per `engine_urls` entry (named by URL; each gives up on its
    server after `MEMBER_OUTAGE_TIMEOUT_S` / `MEMBER_RETRIES` so the router fails over fast), or the embedded
    engine over `loaded` (its worker thread placed by `placement`, its model moved to `engine_device`).
    `lora` (rank, adapters kept): a run that pushes LoRA adapters, which vLLM and SGLang servers load by name."""
    keep = lora[1] if lora is not None else KEEP_ADAPTERS
    if settings.engine == "vllm":
        from relax_gym.engines.vllm import vllm_engine

        return vllm_engine(loaded, settings, lora=lora)
    if settings.engine == "sglang" and settings.engine_urls:
        from relax_gym.engines.router import EngineRouter
        from relax_gym.engines.sglang import SGLangEngine

        return EngineRouter({url: SGLangEngine(url, outage_timeout_s=MEMBER_OUTAGE_TIMEOUT_S, retries=MEMBER_RETRIES,
                                               max_connections=None, keep_adapters=keep)
                             for url in settings.engine_urls},
                            wait_s=settings.engine_outage_timeout_s)
    if settings.engine == "sglang" and settings.engine_url:
        from relax_gym.engines.sglang import SGLangEngine

        return SGLangEngine(settings.engine_url, outage_timeout_s=settings.engine_outage_timeout_s,
                            max_connections=None, keep_adapters=keep)
    from relax_gym.engines.embedded import EmbeddedEngine, engine_device, engine_dtype

    device = engine_device(settings.engine_device)
    dtype = engine_dtype(settings.engine_dtype)
    if dtype is not None and dtype != loaded.model.dtype and device.type == "cpu":
        # the engine casts its model in place, and the trainer copies `loaded` after it: a copy keeps the trainer's
        # weights in their own precision
        loaded = replace(loaded, model=copy.deepcopy(loaded.model))
    return EmbeddedEngine(loaded, max_batch_size=settings.engine_max_batch_size, seed=seed,
                          batching=settings.engine_batching, placement=placement, device=device, dtype=dtype)
