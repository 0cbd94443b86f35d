"""`relax-gym serve`: the embedded engine behind SGLang's native HTTP routes and OpenAI's, assembled here from its
route groups behind the guard, and the process that serves it.

The same `SGLangEngine` client then drives a real SGLang server or this one, so the client is tested over real HTTP
on any machine, and CPU rollout workers can share one served model. The routes, and what each differs from SGLang
in by necessity: `server_generate` (`/generate`, pausing), `server_weights` (weight updates, weights update groups,
the weight-update session), `server_adapters` (LoRA adapters), `server_status` (health, model and server info),
`server_openai` (`/v1/chat/completions`, `/v1/responses`, `/v1/models`); their bodies are `server_schemas`.

What it guards against (limits and defaults: `server_limits.ServerLimits`; transport: `relax_gym.web.guard`):
every route but health and model info needs the API key as a bearer token; a request is refused with a 4xx naming
its field before it costs the server more than its body (a prompt or `max_new_tokens` past the context, media past
their pixel / duration caps, non-finite or out-of-range numbers, text that is not UTF-8); a request that runs past
`request_timeout_s` ends with finish_reason "abort", one whose client goes away is dropped; past `max_pending`
samples the answer is 503 with Retry-After, and a full queue's largest requests yield to smaller ones
(`queue_share`, `server_admission`); weight updates are checked whole (names, shapes, dtypes, finite values) before
they touch the model.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from relax_gym.engines.base import EngineError, RequestError
from relax_gym.engines.embedded import EmbeddedEngine, engine_device
from relax_gym.engines.queue_share import QueueShare
from relax_gym.engines.server_adapters import adapter_routes, load_adapters
from relax_gym.engines.server_generate import generate_routes
from relax_gym.engines.server_limits import ServerLimits
from relax_gym.engines.server_openai import openai_routes
from relax_gym.engines.server_schemas import BadRequest
from relax_gym.engines.server_status import status_routes
from relax_gym.engines.server_weights import weight_routes
from relax_gym.web import serve as web_serve
from relax_gym.web.address import is_loopback
from relax_gym.web.errors import error_response, install_error_handlers
from relax_gym.web.guard import Guard
from relax_gym.web.keys import ENGINE_KEY_ENV, announce_generated_key, resolve_server_key

logger = logging.getLogger("relax_gym.engines")

#: routes anyone may call: liveness and what model is served (as SGLang leaves them open under --api-key)
OPEN_ROUTES = frozenset({"/health", "/health_generate", "/model_info", "/get_model_info"})
#: where a refused client finds the key (the 401 says it)
KEY_HINT = (f"the key the server printed when it started, or the {ENGINE_KEY_ENV} it was started with; relax_gym's "
            f"clients read ${ENGINE_KEY_ENV}")


def create_app(engine: EmbeddedEngine, *, api_key: str | None, limits: ServerLimits | None = None) -> FastAPI:
    """SGLang's native routes and OpenAI's over `engine` (the caller owns and closes it), behind `Guard`; the
    generation and chat routes share one queue (`max_pending`) and one context.

    `api_key=None` turns authentication off: only for a process whose port no one else can reach."""
    limits = limits or ServerLimits()
    app = FastAPI(title="relax_gym embedded engine (SGLang-native API)")
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes, open_routes=OPEN_ROUTES,
                       key_hint=KEY_HINT, cap_hint="max_body_mb")
    install_error_handlers(app)
    context = limits.context_length or engine.context_length
    queue = QueueShare(limits.max_pending)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        status = 400 if isinstance(exc, RequestError) else 500 if await engine.health() else 503
        return error_response(status, str(exc))

    for router in (generate_routes(engine, limits, queue, context), weight_routes(engine), adapter_routes(engine),
                   status_routes(engine, limits, queue, context), openai_routes(engine, limits, queue, context)):
        app.include_router(router)
    return app


def uvicorn_config(app: Any, host: str, port: int, limits: ServerLimits, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's settings for `app` under `limits`: the read deadline, connection cap and SIGTERM drain."""
    return web_serve.uvicorn_config(app, host, port, limits.bounds, drain_timeout_s=limits.drain_timeout_s, **kwargs)


def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    device: str = "auto",
    api_key_file: str | os.PathLike | None = None,
    limits: ServerLimits | None = None,
    adapters: Mapping[str, str] | None = None,
    **engine_kwargs: Any,
) -> None:
    """Loads `model` (a tiny model name or a local HF folder) and serves it until interrupted or SIGTERM
    (requests in flight get `drain_timeout_s` to finish, then are aborted). `device` as `rollout.engine_device`
    takes it: "auto" is the first GPU (in bfloat16) where torch sees one, else the CPU. `adapters` (name ->
    PEFT adapter folder) are loaded before it serves; one that does not load stops it, naming it."""
    from relax_gym.models import load_model

    limits = limits or ServerLimits()
    api_key, generated = resolve_server_key(host, api_key_file, ENGINE_KEY_ENV)
    if not is_loopback(host):
        logger.warning("serving on %s: reachable beyond this machine over plain HTTP, so the API key travels in "
                       "clear; put TLS (a reverse proxy) or an SSH tunnel in front", host)
    engine = EmbeddedEngine(load_model(model), device=engine_device(device), **engine_kwargs)
    try:
        asyncio.run(load_adapters(engine, adapters or {}))
    except BaseException:
        asyncio.run(engine.close())
        raise
    if generated:
        announce_generated_key(api_key, ENGINE_KEY_ENV)
    try:
        uvicorn.Server(uvicorn_config(create_app(engine, api_key=api_key, limits=limits), host, port, limits,
                                      log_level="info")).run()
    finally:
        asyncio.run(engine.close())
