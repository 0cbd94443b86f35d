"""The operators' HTTP API over a training run's rollout engines: status, the engines, scale out / in, operations.

Served by `ControlServer` inside the driver's event loop (where the controller and its `ScaleManager` live), on
127.0.0.1 unless configured otherwise. Every route but `/v1/health` needs `Authorization: Bearer <token>`: the
token scales a cluster up and down, so it is required even on loopback (other users of the machine reach it too).
`resolve_control_token` keeps a generated token in the run folder (mode 0600), where `relax-gym cluster
--run-dir` finds it, with `control.json` naming the server's URL.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from relax_gym.trainer.cluster.control_client import CONTROL_FILE, TOKEN_FILE
from relax_gym.trainer.cluster.scale import (
    DEFAULT_DRAIN_TIMEOUT_S,
    EngineFleet,
    ScaleManager,
    ScaleRejected,
    ScaleResult,
)
from relax_gym.web import bounds
from relax_gym.web.address import is_loopback
from relax_gym.web.errors import error_response, install_error_handlers
from relax_gym.web.guard import Guard
from relax_gym.web.keys import CONTROL_TOKEN_ENV, key_from_env, new_key, write_secret
from relax_gym.web.serve import InLoopServer

logger = logging.getLogger("relax_gym.trainer.cluster")

#: routes anyone may call (a liveness probe)
OPEN_PATHS = frozenset({"/v1/health"})
#: bounds of a scale request's numbers: a count or a wait past these is a typo or an attack, answered 400
MAX_ENGINES = 1024
MAX_WAIT_S = 86400.0
#: where a refused client finds the token (the 401 says it)
KEY_HINT = f"the control token: the run folder's {TOKEN_FILE}, or ${CONTROL_TOKEN_ENV}"


class ScaleOutIn(BaseModel):
    """Exactly one of a target count and URLs of external servers (`ScaleManager.scale_out` says why)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    num_engines: int | None = Field(None, ge=0, le=MAX_ENGINES)
    engine_urls: list[str] | None = Field(None, max_length=MAX_ENGINES)
    timeout_s: float | None = Field(None, gt=0, le=MAX_WAIT_S)


class ScaleInIn(BaseModel):
    """Exactly one of a target count and engine ids (`ScaleManager.scale_in` says why)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    num_engines: int | None = Field(None, ge=0, le=MAX_ENGINES)
    engine_ids: list[str] | None = Field(None, max_length=MAX_ENGINES)
    drain_timeout_s: float = Field(DEFAULT_DRAIN_TIMEOUT_S, ge=0, le=MAX_WAIT_S)
    force: bool = False
    dry_run: bool = False


def create_control_app(fleet: EngineFleet, manager: ScaleManager, token: str) -> FastAPI:
    """The control routes over `fleet` and `manager` (the caller owns both), behind the bearer `token`."""
    if not token:
        raise ValueError("the control API needs a non-empty token")
    app = FastAPI(title="relax_gym control API", docs_url=None, redoc_url=None)
    app.add_middleware(Guard, api_key=token, max_body_bytes=bounds.CONTROL_API.max_body_bytes,
                       open_routes=OPEN_PATHS, key_hint=KEY_HINT)
    install_error_handlers(app)

    @app.exception_handler(ScaleRejected)
    async def _rejected(request: Request, exc: ScaleRejected) -> JSONResponse:
        running = {} if exc.running_op_id is None else {"running_op_id": exc.running_op_id}
        return error_response(exc.status, str(exc), extra=running)

    def answer(result: ScaleResult) -> JSONResponse:
        return JSONResponse(result.record, status_code=202 if result.started else 200)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        counts = Counter(e.state for e in fleet.engines())
        return {**fleet.status(), "engines": dict(counts), "running_op_id": manager.running_op_id()}

    @app.get("/v1/engines")
    async def engines() -> list[dict[str, Any]]:
        return [asdict(e) for e in fleet.engines()]

    @app.post("/v1/engines/scale_out")
    async def scale_out(body: ScaleOutIn,
                        idempotency_key: Annotated[str | None, Header()] = None) -> JSONResponse:
        return answer(await manager.scale_out(body.num_engines, body.engine_urls, body.timeout_s, idempotency_key))

    @app.post("/v1/engines/scale_in")
    async def scale_in(body: ScaleInIn,
                       idempotency_key: Annotated[str | None, Header()] = None) -> JSONResponse:
        return answer(await manager.scale_in(body.num_engines, body.engine_ids, body.drain_timeout_s, body.force,
                                             body.dry_run, idempotency_key))

    @app.get("/v1/ops")
    async def ops() -> list[dict[str, Any]]:
        return manager.ops()

    @app.get("/v1/ops/{op_id}")
    async def op(op_id: str) -> dict[str, Any]:
        return manager.op(op_id)

    @app.post("/v1/ops/{op_id}/cancel")
    async def cancel(op_id: str) -> dict[str, Any]:
        return await manager.cancel(op_id)

    return app


def resolve_control_token(run_dir: Path, configured: str | None) -> str:
    """The control API's token: `configured`, else `$RELAX_GYM_CONTROL_TOKEN`, else the run folder's
    `control_token` (a resumed run keeps its token), else a new one written there with mode 0600."""
    if configured and configured.strip():
        return configured.strip()
    if env := key_from_env(CONTROL_TOKEN_ENV):
        return env
    path = Path(run_dir) / TOKEN_FILE
    if path.exists() and (token := path.read_text().strip()):
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("%s is readable by other users: chmod 600 it", path)
        return token
    token = new_key()
    write_secret(path, token)
    return token


class ControlServer:
    """Serves the control app in the running event loop (the controller's), on an `InLoopServer`.

    `start` returns once it accepts connections (and has written `run_dir/control.json`); `stop` ends it and
    removes that file. On a non-loopback `host` the token still guards every route, but it crosses the network in
    clear: a warning says so."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, run_dir: Path | None = None,
                 start_timeout_s: float = 10.0) -> None:
        self.host = host
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._server = InLoopServer(app, bounds.CONTROL_API, host, port, name="control API",
                                    start_timeout_s=start_timeout_s)

    @property
    def url(self) -> str:
        return self._server.url

    async def start(self) -> str:
        """Binds, serves, and returns the URL (with the real port when `port` was 0)."""
        if not is_loopback(self.host):
            logger.warning("control API on %s: reachable beyond this machine over plain HTTP, so its token travels "
                           "in clear; put TLS (a reverse proxy) or an SSH tunnel in front", self.host)
        url = await self._server.start()
        logger.info("control API at %s", url)
        if self.run_dir is not None:
            self._write_control_file(url)
        return url

    async def stop(self) -> None:
        """Stops serving (requests in flight get a few seconds) and removes `control.json` if it is still ours."""
        await self._server.stop()
        if self.run_dir is not None:
            path = self.run_dir / CONTROL_FILE
            with contextlib.suppress(OSError, ValueError):
                if json.loads(path.read_text()).get("pid") == os.getpid():
                    path.unlink()

    async def __aenter__(self) -> ControlServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _write_control_file(self, url: str) -> None:
        assert self.run_dir is not None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / f".{CONTROL_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}) + "\n")
        os.replace(tmp, self.run_dir / CONTROL_FILE)
