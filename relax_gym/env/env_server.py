"""`relax-gym env-server`: one registered env served over HTTP, one session per episode.

An env that is heavy, unsafe or needs another machine's resources runs here, and the trainer's rollout
manager drives it through `relax_gym.RemoteEnv` as it drives any env. Routes (JSON; messages and media as
`relax_gym.env.env_wire` writes them):

- `GET /health` (open): "ok";
- `GET /info`: the env id, its tool schemas and modalities, the open sessions;
- `POST /sessions` {tool_format?}: a new session (an env instance), its id;
- `POST /sessions/{id}/reset` {seed?, options?}: the observation, already formatted as messages, and info;
- `POST /sessions/{id}/step` {action}: the observation (messages), reward, terminated, truncated, info;
- `DELETE /sessions/{id}`: closes it.

The env runs with the kwargs the server was started with (a client never chooses them: a `data_path` would
read the server's files). Every route but /health needs the env server's key (`$RELAX_GYM_ENV_KEY`, never the
engine's: `relax_gym.web.keys`), and the server binds to loopback unless told otherwise. A session left alone
`session_timeout_s` is closed; past `max_sessions` a new one is refused (503). An env that raises answers 500
with the exception's type and message, and its session is closed: the episode is over. A client's own mistake
is a 4xx and the session stays: a seed out of range (400), options the env refuses at reset (400), a step before
reset or after the end (409).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from relax_gym.env.core import Env, EpisodeOverError
from relax_gym.env.env_wire import messages_to_json, plain
from relax_gym.env.registration import make
from relax_gym.errors import StartupError
from relax_gym.web import bounds
from relax_gym.web.errors import error_response, install_error_handlers
from relax_gym.web.guard import Guard
from relax_gym.web.keys import ENV_SERVER_KEY_ENV, announce_generated_key, resolve_server_key
from relax_gym.web.serve import uvicorn_config

#: where a refused client finds the key (the 401 says it)
KEY_HINT = (f"the key the env server printed when it started, or the {ENV_SERVER_KEY_ENV} it was started with; "
            f"RemoteEnv reads ${ENV_SERVER_KEY_ENV}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SessionIn(_Strict):
    tool_format: str | None = None


class ResetIn(_Strict):
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)  # a task seed: gymnasium seeds numpy with a non-negative int
    options: dict[str, Any] | None = None


class StepIn(_Strict):
    action: str


@dataclass
class _Session:
    env: Env
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class EnvSessions:
    """The env instances of open sessions, made with the server's kwargs, closed when idle too long."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any], *, max_sessions: int, timeout_s: float,
                 allow_unsandboxed_code: bool = False):
        self.env_id, self.env_kwargs = env_id, dict(env_kwargs)
        self.max_sessions, self.timeout_s = max_sessions, timeout_s
        self.sessions: dict[str, _Session] = {}
        #: made once at start: its tool schemas and metadata describe every session's env
        self.probe = make(env_id, **self.env_kwargs)
        if self.probe.metadata.get("sandbox") and not allow_unsandboxed_code:
            self._require_container()

    def _require_container(self) -> None:
        """An env that runs a client's model-written code is served only with a container sandbox: no fallback to a
        subprocess on this host (which would run as the server's user, next to its key), unless the operator
        opts in by name."""
        from relax_gym.sandbox import SandboxConfig, container_unavailable

        if "require_container" in inspect.signature(type(self.probe)).parameters and \
                "require_container" not in self.env_kwargs:  # no session may fall back later either
            self.probe.close()
            self.env_kwargs["require_container"] = True
            self.probe = make(self.env_id, **self.env_kwargs)
        why = container_unavailable(getattr(self.probe, "sandbox_config", SandboxConfig()))
        if why is not None:
            self.probe.close()
            raise StartupError(f"env-server {self.env_id}: this env runs model-written code, and no container "
                               f"sandbox can be used ({why}), so a client's code would run on this host. Start "
                               "one (bash scripts/start_podman.sh, then bash scripts/build_sandbox_image.sh), or "
                               "pass --allow-unsandboxed-code to accept that risk")

    def open(self, tool_format: str | None) -> str:
        if len(self.sessions) >= self.max_sessions:
            raise Refused(503, f"{len(self.sessions)} sessions are open, the server's limit (max_sessions)")
        env = make(self.env_id, **self.env_kwargs)
        if tool_format is not None and hasattr(env, "tool_format"):
            from relax_gym.tools import get_tool_format

            try:
                env.tool_format = get_tool_format(tool_format)
            except (KeyError, ValueError) as err:
                env.close()
                raise Refused(400, f"tool_format: {err}") from None
        sid = secrets.token_urlsafe(12)
        self.sessions[sid] = _Session(env)
        return sid

    def get(self, sid: str) -> _Session:
        session = self.sessions.get(sid)
        if session is None:
            raise Refused(404, f"no session {sid!r} (closed, timed out after {self.timeout_s:g} s, or never opened)")
        session.last_used = time.monotonic()
        return session

    def close(self, sid: str) -> None:
        session = self.sessions.pop(sid, None)
        if session is not None:
            session.env.close()

    def close_idle(self) -> int:
        now = time.monotonic()
        idle = [sid for sid, s in self.sessions.items() if now - s.last_used > self.timeout_s and not s.lock.locked()]
        for sid in idle:
            self.close(sid)
        return len(idle)

    def close_all(self) -> None:
        for sid in list(self.sessions):
            self.close(sid)
        self.probe.close()


class Refused(Exception):
    """A request the env server answers with `status` and this message (a full server, an unknown session, an env
    that raised)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def create_app(env_id: str, env_kwargs: dict[str, Any] | None = None, *, api_key: str | None,
               max_sessions: int = 1024, session_timeout_s: float = 600.0, allow_unsandboxed_code: bool = False) -> Any:
    """The ASGI app (behind the API-key and body-size guard). An env that runs model-written code (metadata
    `sandbox`) is served only where a container sandbox works, unless `allow_unsandboxed_code`."""
    sessions = EnvSessions(env_id, env_kwargs or {}, max_sessions=max_sessions, timeout_s=session_timeout_s,
                           allow_unsandboxed_code=allow_unsandboxed_code)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def sweep() -> None:
            while True:
                await asyncio.sleep(min(30.0, session_timeout_s / 2))
                sessions.close_idle()

        sweeper = asyncio.create_task(sweep())
        try:
            yield
        finally:
            sweeper.cancel()
            sessions.close_all()

    app = FastAPI(title=f"relax-gym env-server: {env_id}", lifespan=lifespan)
    app.state.sessions = sessions
    install_error_handlers(app)

    @app.exception_handler(Refused)
    async def _refused(request: Request, exc: Refused) -> Any:
        return error_response(exc.status, str(exc))

    @app.get("/health")
    async def health() -> str:
        return "ok"

    @app.get("/info")
    async def info() -> dict[str, Any]:
        probe = sessions.probe
        return {"env_id": env_id, "tool_schemas": plain(probe.tool_schemas),
                "modalities": list(probe.metadata.get("modalities", ("text",))),
                "sessions": len(sessions.sessions), "max_sessions": max_sessions,
                "session_timeout_s": session_timeout_s}

    @app.post("/sessions")
    async def open_session(body: SessionIn) -> dict[str, str]:
        return {"session_id": await asyncio.to_thread(sessions.open, body.tool_format)}

    async def run(sid: str, what: str, call: Any, client_errors: tuple[type[Exception], ...] = ()) -> Any:
        """`call` on the session's env. A client's mistake (a step out of order, `client_errors`) is a 4xx and the
        session stays; any other exception is the env's failure, which ends its episode (500, session closed)."""
        session = sessions.get(sid)
        async with session.lock:  # one call at a time per episode
            try:
                result = await call(session.env)
            except EpisodeOverError as err:  # a step before reset or after the end: the client may reset
                raise Refused(409, f"env {what}: {err}") from None
            except client_errors as err:
                raise Refused(400, f"env {what} refused the request: {type(err).__name__}: {err}") from None
            except Exception as err:  # the env's failure ends its episode; the server goes on
                sessions.close(sid)
                raise Refused(500, f"env {what} raised {type(err).__name__}: {err}") from None
            session.last_used = time.monotonic()
            return result

    @app.post("/sessions/{sid}/reset")
    async def reset(sid: str, body: ResetIn) -> dict[str, Any]:
        async def call(env: Env) -> dict[str, Any]:
            obs, info = await env.areset(seed=body.seed, options=body.options)
            return {"observation": messages_to_json(env.format_observation(obs)), "info": plain(info)}
        # options the env cannot take are the client's (a reset may be asked again); without options, the env's
        return await run(sid, "reset", call, (ValueError, KeyError, IndexError, TypeError) if body.options else ())

    @app.post("/sessions/{sid}/step")
    async def step(sid: str, body: StepIn) -> dict[str, Any]:
        async def call(env: Env) -> dict[str, Any]:
            obs, reward, terminated, truncated, info = await env.astep(body.action)
            observation = [] if terminated or truncated else messages_to_json(env.format_observation(obs))
            return {"observation": observation, "reward": float(reward), "terminated": bool(terminated),
                    "truncated": bool(truncated), "info": plain(info)}
        return await run(sid, "step", call)

    @app.delete("/sessions/{sid}")
    async def close(sid: str) -> dict[str, bool]:
        sessions.close(sid)
        return {"closed": True}

    return Guard(app, api_key=api_key, max_body_bytes=bounds.ENV_SERVER.max_body_bytes, open_routes={"/health"},
                 key_hint=KEY_HINT)


def serve_env(env_id: str, env_kwargs: dict[str, Any] | None = None, *, host: str = "127.0.0.1", port: int = 8100,
              api_key_file: str | None = None, max_sessions: int = 1024, session_timeout_s: float = 600.0,
              allow_unsandboxed_code: bool = False) -> None:
    """Serves `env_id` until interrupted (see the module docstring); the key from `api_key_file`, else
    `$RELAX_GYM_ENV_KEY`, else generated and printed (on loopback only)."""
    api_key, generated = resolve_server_key(host, api_key_file, ENV_SERVER_KEY_ENV)
    app = create_app(env_id, env_kwargs, api_key=api_key, max_sessions=max_sessions,
                     session_timeout_s=session_timeout_s, allow_unsandboxed_code=allow_unsandboxed_code)
    if generated:
        announce_generated_key(api_key, ENV_SERVER_KEY_ENV)
    uvicorn.Server(uvicorn_config(app, host, port, bounds.ENV_SERVER, log_level="warning")).run()
