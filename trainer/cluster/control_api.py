"""The operators' HTTP API over a training run's rollout engines: status, the engines, scale out / in, operations.

Served by `ControlServer` inside the driver's event loop (where the controller and its `ScaleManager` live), on
127.0.0.1 unless configured otherwise. Every route but `/v1/health` needs `Authorization: Bearer <token>`: the
token scales a cluster up and down, so it is required even on loopback (other users of the machine reach it too).
`resolve_control_token` keeps a generated token in the run folder (mode 0600), where `relax-gym cluster
--run-dir` finds it, with `control.json` naming the server's URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import socket
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from relax_gym.control_client import CONTROL_FILE, CONTROL_TOKEN_ENV, TOKEN_FILE
from relax_gym.engines.server_guard import protocol_class
from relax_gym.trainer.cluster.scale import (
    DEFAULT_DRAIN_TIMEOUT_S,
    EngineFleet,
    ScaleManager,
    ScaleRejected,
    ScaleResult,
)

logger = logging.getLogger("relax_gym.trainer.cluster")

#: routes anyone may call (a liveness probe)
OPEN_PATHS = frozenset({"/v1/health"})
#: a request's header and body must arrive within this (uvicorn has no such deadline); connections served at once
READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64


class ScaleOutIn(BaseModel):
    """Exactly one of a target count and URLs of external servers (`ScaleManager.scale_out` says why)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    num_engines: int | None = None
    engine_urls: list[str] | None = None
    timeout_s: float | None = None


class ScaleInIn(BaseModel):
    """Exactly one of a target count and engine ids (`ScaleManager.scale_in` says why)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    num_engines: int | None = None
    engine_ids: list[str] | None = None
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    force: bool = False
    dry_run: bool = False


class BearerAuth:
    """ASGI middleware: the token on every route but `OPEN_PATHS`, checked before the body is read or parsed."""

    def __init__(self, app: Any, *, token: str) -> None:
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            message = (f"missing or wrong control token: send 'Authorization: Bearer <token>' (the run folder's "
                       f"{TOKEN_FILE}, or {CONTROL_TOKEN_ENV})")
            response = JSONResponse({"detail": message}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._token)


def _field_error(err: Any) -> str:
    if err["type"] == "json_invalid":
        return "body: not valid JSON"
    return f"{'.'.join(str(p) for p in err['loc'] if p != 'body') or 'body'}: {err['msg']}"


def create_control_app(fleet: EngineFleet, manager: ScaleManager, token: str) -> FastAPI:
    """The control routes over `fleet` and `manager` (the caller owns both), behind the bearer `token`."""
    if not token:
        raise ValueError("the control API needs a non-empty token")
    app = FastAPI(title="relax_gym control API", docs_url=None, redoc_url=None)
    app.add_middleware(BearerAuth, token=token)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": "; ".join(_field_error(e) for e in exc.errors())}, status_code=400)

    @app.exception_handler(ScaleRejected)
    async def _rejected(request: Request, exc: ScaleRejected) -> JSONResponse:
        body: dict[str, Any] = {"detail": str(exc)}
        if exc.running_op_id is not None:
            body["running_op_id"] = exc.running_op_id
        return JSONResponse(body, status_code=exc.status)

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
    if env := os.environ.get(CONTROL_TOKEN_ENV, "").strip():
        return env
    path = Path(run_dir) / TOKEN_FILE
    if path.exists() and (token := path.read_text().strip()):
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("%s is readable by other users: chmod 600 it", path)
        return token
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # the mode O_CREAT gives applies only to a new file
        f.write(token + "\n")
    return token


class LoopServer(uvicorn.Server):
    """uvicorn inside a running event loop, without its signal handlers: Ctrl-C and SIGTERM belong to the process
    hosting it (the training run, an engine actor), not to the server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket: bound here, so a taken port is an OSError to the caller (uvicorn would `sys.exit`)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class ControlServer:
    """Serves the control app with uvicorn as a task in the running event loop (the controller's).

    `start` returns once it accepts connections (and has written `run_dir/control.json`); `stop` ends it and
    removes that file. On a non-loopback `host` the token still guards every route, but it crosses the network in
    clear: a warning says so."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, run_dir: Path | None = None,
                 start_timeout_s: float = 10.0) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.start_timeout_s = start_timeout_s
        self._server: LoopServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the control server is not started")
        return self._url

    async def start(self) -> str:
        """Binds, serves, and returns the URL (with the real port when `port` was 0)."""
        from relax_gym.engines.server import is_loopback  # here: that module brings torch, which the run has

        if self._task is not None:
            raise RuntimeError("the control server is already started")
        if not is_loopback(self.host):
            logger.warning("control API on %s: reachable beyond this machine over plain HTTP, so its token travels "
                           "in clear; put TLS (a reverse proxy) or an SSH tunnel in front", self.host)
        sock = bind_listener(self.host, self.port)
        bound_host, port = sock.getsockname()[:2]
        # log_config=None: uvicorn's records go through the run's logging instead of handlers of its own
        config = uvicorn.Config(self.app, host=self.host, port=port, log_level="warning", log_config=None,
                                access_log=False, lifespan="off", http=protocol_class(READ_TIMEOUT_S),
                                limit_concurrency=MAX_CONNECTIONS)
        server = self._server = LoopServer(config)

        async def serve() -> None:
            try:
                await server.serve(sockets=[sock])
            except SystemExit as err:  # uvicorn's way to report a startup failure: never the run's exit
                raise RuntimeError(f"the control server did not start (uvicorn exited with {err.code})") from None
            finally:
                sock.close()

        self._task = asyncio.get_running_loop().create_task(serve(), name="relax_gym control API")
        deadline = asyncio.get_running_loop().time() + self.start_timeout_s
        while not server.started:
            if self._task.done():
                self._task.result()  # its error
                raise RuntimeError("the control server stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                await self.stop()
                raise RuntimeError(f"the control server did not start within {self.start_timeout_s:g} s")
            await asyncio.sleep(0.01)
        shown = bound_host
        if shown in ("0.0.0.0", "::"):  # listening everywhere: this machine reaches it on loopback
            shown = "127.0.0.1" if shown == "0.0.0.0" else "::1"
        self._url = f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
        logger.info("control API at %s", self._url)
        if self.run_dir is not None:
            self._write_control_file()
        return self._url

    async def stop(self) -> None:
        """Stops serving (requests in flight get a few seconds) and removes `control.json` if it is still ours."""
        server, task = self._server, self._task
        self._server = self._task = None
        if server is None or task is None:
            return
        server.should_exit = True
        done, _ = await asyncio.wait({task}, timeout=5.0)
        if not done:
            server.force_exit = True
            task.cancel()
            await asyncio.wait({task})
        if self.run_dir is not None:
            path = self.run_dir / CONTROL_FILE
            with contextlib.suppress(OSError, ValueError):
                if json.loads(path.read_text()).get("pid") == os.getpid():
                    path.unlink()
        self._url = None

    async def __aenter__(self) -> ControlServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _write_control_file(self) -> None:
        assert self.run_dir is not None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / f".{CONTROL_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"url": self._url, "pid": os.getpid()}) + "\n")
        os.replace(tmp, self.run_dir / CONTROL_FILE)
