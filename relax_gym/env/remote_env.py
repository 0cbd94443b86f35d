"""`RemoteEnv`: an `Env` whose episodes run in a `relax-gym env-server` (another process, container or host).

Each reset opens a new session on the server (closing the previous one), so one `RemoteEnv` is one episode
at a time, as any env instance is; the rollout manager's env pool keeps several. Observations come back
already formatted as messages (media included), so `format_observation` passes them through. A server that
cannot be reached, or an env that raised there, raises `RemoteEnvError` naming the server and the cause:
the rollout manager ends that episode `failed` with it, and the others go on.

    relax-gym env-server relax/GuessNumber-v0 --port 8100
    relax_gym.make("relax/Remote-v0", url="http://127.0.0.1:8100")   # the key from $RELAX_GYM_ENV_KEY
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from relax_gym.env.core import Env, StepResult
from relax_gym.env.env_wire import messages_from_json
from relax_gym.env.spaces import MessageSpace
from relax_gym.messages import Message
from relax_gym.web.client import bearer, error_message
from relax_gym.web.keys import ENV_SERVER_KEY_ENV, key_from_env


class RemoteEnvError(RuntimeError):
    """The env server could not be reached or answered with an error (its message says which)."""


class RemoteEnv(Env[list[Message]]):
    """An env served by `relax-gym env-server` at `url` (see the module docstring)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 120.0):
        """`api_key`: the env server's key (default `$RELAX_GYM_ENV_KEY`; never the engine's)."""
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = bearer(api_key if api_key is not None else key_from_env(ENV_SERVER_KEY_ENV))
        self._session: str | None = None
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        info = self._sync("GET", "/info")
        self.env_id = str(info["env_id"])
        self._tool_schemas: list[dict[str, Any]] = list(info.get("tool_schemas") or [])
        modalities = tuple(info.get("modalities") or ("text",))
        self.metadata = {**Env.metadata, "modalities": modalities}
        self.observation_space = MessageSpace(modalities=modalities)
        #: the model's tool-call format, set by the rollout manager; sent with each new session
        self.tool_format: Any = None

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return self._tool_schemas

    def format_observation(self, observation: list[Message]) -> list[Message]:
        return list(observation)  # the server formatted it

    # --- sync API ---------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[list[Message], dict]:
        super().reset(seed=seed)
        self._close_session_sync()
        self._session = self._sync("POST", "/sessions", self._session_body())["session_id"]
        answer = self._sync("POST", f"/sessions/{self._session}/reset", {"seed": seed, "options": options})
        return messages_from_json(answer["observation"]), answer["info"]

    def step(self, action: str) -> StepResult:
        result = self._stepped(self._sync("POST", f"/sessions/{self._running()}/step", {"action": action}))
        if result[2] or result[3]:
            self._close_session_sync()  # the episode is over: its env on the server goes now, not at the timeout
        return result

    def close(self) -> None:
        self._close_session_sync()

    # --- async API (what the rollout manager calls) --------------------------------------------
    async def areset(self, *, seed: int | None = None,
                     options: dict[str, Any] | None = None) -> tuple[list[Message], dict]:
        super().reset(seed=seed)
        await self._close_session_async()
        self._session = (await self._async("POST", "/sessions", self._session_body()))["session_id"]
        answer = await self._async("POST", f"/sessions/{self._session}/reset", {"seed": seed, "options": options})
        return messages_from_json(answer["observation"]), answer["info"]

    async def astep(self, action: str) -> StepResult:
        result = self._stepped(await self._async("POST", f"/sessions/{self._running()}/step", {"action": action}))
        if result[2] or result[3]:
            await self._close_session_async()  # the episode is over: its env on the server goes now
        return result

    # --- plumbing -------------------------------------------------------------------------------
    def _session_body(self) -> dict[str, Any]:
        name = getattr(self.tool_format, "name", self.tool_format)
        return {"tool_format": name if isinstance(name, str) else None}

    def _running(self) -> str:
        if self._session is None:
            raise RemoteEnvError("call reset() before step(): no session is open")
        return self._session

    def _stepped(self, answer: dict[str, Any]) -> StepResult:
        return (messages_from_json(answer["observation"]), float(answer["reward"]), bool(answer["terminated"]),
                bool(answer["truncated"]), answer["info"])

    def _close_session_sync(self) -> None:
        if self._session is not None:
            self._sync("DELETE", f"/sessions/{self._session}", quiet=True)
            self._session = None

    async def _close_session_async(self) -> None:
        if self._session is not None:
            await self._async("DELETE", f"/sessions/{self._session}", quiet=True)
            self._session = None

    def _sync(self, method: str, path: str, body: Any = None, *, quiet: bool = False) -> Any:
        try:
            response = httpx.request(method, self.url + path, json=body, headers=self._headers,
                                     timeout=self.timeout_s)
        except httpx.HTTPError as err:
            if quiet:
                return None
            raise RemoteEnvError(f"env server at {self.url} unreachable: {type(err).__name__}: {err}") from None
        return self._answer(response, quiet)

    async def _async(self, method: str, path: str, body: Any = None, *, quiet: bool = False) -> Any:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:  # a client belongs to the loop that made it
            self._client = httpx.AsyncClient(headers=self._headers, timeout=self.timeout_s)
            self._client_loop = loop
        try:
            response = await self._client.request(method, self.url + path, json=body)
        except httpx.HTTPError as err:
            if quiet:
                return None
            raise RemoteEnvError(f"env server at {self.url} unreachable: {type(err).__name__}: {err}") from None
        return self._answer(response, quiet)

    def _answer(self, response: httpx.Response, quiet: bool) -> Any:
        if response.status_code >= 400:
            if quiet:
                return None
            raise RemoteEnvError(f"env server at {self.url} answered {response.status_code}: "
                                 f"{error_message(response)}")
        return response.json()
