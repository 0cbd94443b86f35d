"""Inference engines: one async protocol (`Engine`), an embedded transformers engine, an SGLang client,
a router that makes several engines look like one,
and a scripted engine that replays hand-written replies (to test an env without a model).

Implementations import lazily, so `from relax_gym.engines import Engine` costs no
torch, httpx or FastAPI import.
"""

from __future__ import annotations

import importlib
from typing import Any

from relax_gym.engines.base import (
    API_KEY_ENV,
    Engine,
    EngineError,
    EngineGoneError,
    EngineUnavailableError,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    RequestError,
    SamplingParams,
)

_LAZY = {
    "EmbeddedEngine": "relax_gym.engines.embedded",
    "SGLangEngine": "relax_gym.engines.sglang",
    "SGLangServer": "relax_gym.engines.sglang",
    "launch_sglang_server": "relax_gym.engines.sglang",
    "create_app": "relax_gym.engines.server",
    "serve": "relax_gym.engines.server",
    "ServerLimits": "relax_gym.engines.server_limits",
    "ScriptError": "relax_gym.engines.scripted",
    "ScriptedEngine": "relax_gym.engines.scripted",
    "ScriptedTurn": "relax_gym.engines.scripted",
    "EngineSettings": "relax_gym.engines.factory",
    "make_engine": "relax_gym.engines.factory",
    "EngineRouter": "relax_gym.engines.router",
}

__all__ = [
    "API_KEY_ENV",
    "EmbeddedEngine",
    "Engine",
    "EngineError",
    "EngineGoneError",
    "EngineRouter",
    "EngineSettings",
    "EngineUnavailableError",
    "FinishReason",
    "GenerateOutput",
    "GenerateRequest",
    "RequestError",
    "SGLangEngine",
    "SGLangServer",
    "SamplingParams",
    "ScriptError",
    "ScriptedEngine",
    "ScriptedTurn",
    "ServerLimits",
    "create_app",
    "launch_sglang_server",
    "make_engine",
    "serve",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
