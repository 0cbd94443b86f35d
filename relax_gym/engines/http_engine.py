"""What every HTTP engine client shares (SGLang's native API, vLLM's RL routes): the connection pool, the
bearer key, and one rule for an answer that is not a success.

Outages are waited out: connection failures and 502/503/504 answers are retried
with capped exponential backoff for up to `outage_timeout_s` (a restarting
server comes back within that), then `EngineUnavailableError`. A server that
answers anything else has answered: 4xx is a `RequestError` (with its status),
500/501 an `EngineError`, both at once; a read timeout is an error too (the
request may still be running). The connection pool is unlimited unless
`max_connections` is given, and never times out on its own, so a pool smaller
than the run's concurrency cannot abort requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from relax_gym.engines.base import EngineError, EngineUnavailableError, RequestError
from relax_gym.engines.http_pool import ShardedTransport
from relax_gym.web.client import backoff_delay, bearer, error_message
from relax_gym.web.keys import ENGINE_KEY_ENV, key_from_env

logger = logging.getLogger("relax_gym.engines")

#: answers from a server (or its proxy) that is down or restarting, not a verdict on the request
OUTAGE_STATUSES = frozenset({502, 503, 504})
#: seconds an unreachable server is waited for by default (`rollout.engine_outage_timeout_s` reads it here)
OUTAGE_TIMEOUT_S = 120.0


def version_number(value: Any, fallback: int) -> int:
    """A server's weight version as the integer relax_gym gave it; `fallback` for one it did not give (SGLang's
    and vLLM's initial "default")."""
    if isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit()):
        return int(value)
    return fallback


def span_versions(spans: list[dict[str, Any]] | None, tokens: int, before: int) -> list[int] | None:
    """Per-token versions from `weight_versions` spans ([{version, start, end}], `end` exclusive: SGLang 0.5.21+'s
    and vLLM 0.32's), when they cover the output and differ; None otherwise (every token has the answer's
    version). A version that is not a number ("default") is `before`, the one the client last knew."""
    if not spans:
        return None
    out: list[int] = []
    for span in spans:
        out += [version_number(span.get("version"), before)] * (int(span["end"]) - int(span["start"]))
    if len(out) != tokens or len(set(out)) < 2:
        return None
    return out


def _client_of(kind: type[HTTPEngine], base_url: str, settings: dict[str, Any]) -> HTTPEngine:
    return kind(base_url, **settings)


class HTTPEngine:
    """An httpx client of one engine server at `base_url`; subclasses speak its routes."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        outage_timeout_s: float = OUTAGE_TIMEOUT_S,
        backoff_s: float = 0.5,
        max_backoff_s: float = 5.0,
        retries: int | None = None,
        max_connections: int | None = None,
        api_key: str | None = None,
        **settings: Any,
    ) -> None:
        """`timeout_s` bounds one request's reads; `outage_timeout_s` how long one call waits out an unreachable
        server (`retries`, if given, also caps its retries); `max_connections=None` leaves the pool unlimited,
        so it never caps the run's concurrency (size it to the run's concurrency otherwise). `api_key` (default:
        the RELAX_GYM_API_KEY environment variable) goes as a bearer token, as SGLang's and vLLM's `--api-key`
        expect. `settings` are the subclass's own, kept so that a pickled client is made again with them."""
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.outage_timeout_s = outage_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.retries = retries
        self._version = 0
        self._down_since: float | None = None  # when the current outage began (monotonic), None while reachable
        self._outages = 0
        api_key = api_key if api_key is not None else key_from_env(ENGINE_KEY_ENV)
        self._settings = {"timeout_s": timeout_s, "outage_timeout_s": outage_timeout_s, "backoff_s": backoff_s,
                          "max_backoff_s": max_backoff_s, "retries": retries, "max_connections": max_connections,
                          "api_key": api_key, **settings}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=bearer(api_key),
            # pool=None: waiting for a free connection never aborts a request that its own timeout would allow
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0), pool=None),
            transport=ShardedTransport(max_connections),  # one httpcore pool is O(n²) in concurrent requests
        )

    #: attributes a pickled client carries over (`__reduce__`)
    _carried: tuple[str, ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        """A pickled client is a fresh client of the same server with the same settings (a rollout worker gets
        its engines' clients this way), carrying `_carried` (the adapters the server holds, so a worker's copy
        names the newest); its connections and outage state stay with the original."""
        return (_client_of, (type(self), self.base_url, self._settings),
                {name: getattr(self, name) for name in self._carried})

    @property
    def weight_version(self) -> int:
        """The version of the last output or update seen (0 before any)."""
        return self._version

    @property
    def outages(self) -> int:
        """Outages waited out so far: a server that came back may have restarted on other weights."""
        return self._outages

    async def health(self) -> bool:
        try:
            response = await self._client.get("/health", timeout=min(self.timeout_s, 10.0))
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def close(self) -> None:
        await self._client.aclose()

    async def _request(self, method: str, route: str, payload: dict[str, Any] | None,
                       params: dict[str, Any] | None = None) -> httpx.Response:
        """One call, waiting out an outage (see the module docstring); an EngineError naming the server otherwise.

        Only `httpx.HTTPError`s are caught: cancellation (Ctrl-C) ends the wait at once."""
        where = f"server at {self.base_url}"
        failed_at: float | None = None
        attempt = 0
        while True:
            try:
                response = await self._client.request(method, route, json=payload, params=params)
            except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout) as err:
                raise EngineError(f"{where} did not answer {route} within {self.timeout_s} s") from err
            except httpx.TransportError as err:
                last = f"unreachable ({type(err).__name__}: {err})"
            else:
                if response.status_code not in OUTAGE_STATUSES:
                    self._reachable()
                    if response.status_code < 400:
                        return response
                    message = f"{where} answered {response.status_code} to {route}: {error_message(response)}"
                    if response.status_code < 500:
                        raise RequestError(message, response.status_code)
                    raise EngineError(message)
                last = f"answered {response.status_code}: {error_message(response)}"
            now = time.monotonic()
            failed_at = now if failed_at is None else failed_at
            self._unreachable(route, last)
            attempt += 1
            left = self.outage_timeout_s - (now - failed_at)
            if left <= 0 or (self.retries is not None and attempt > self.retries):
                raise EngineUnavailableError(
                    f"{where} failed {route} after {attempt} attempts over {now - failed_at:.1f} s "
                    f"(outage_timeout_s={self.outage_timeout_s:g}); last error: {last}"
                )
            await asyncio.sleep(min(backoff_delay(attempt, self.backoff_s, self.max_backoff_s), left))

    def _unreachable(self, route: str, error: str) -> None:
        """One warning per outage, however many calls and retries wait it out."""
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning(
                "server at %s is unreachable (%s: %s); waiting up to %g s per call for it to come back",
                self.base_url, route, error, self.outage_timeout_s,
            )

    def _reachable(self) -> None:
        if self._down_since is not None:
            logger.warning("server at %s is back after %.1f s", self.base_url, time.monotonic() - self._down_since)
            self._down_since = None
            self._outages += 1


# Asks the kernel for SIGKILL when the thread that started it ends (prctl PR_SET_PDEATHSIG, which survives
# exec), leaves at once if that parent is already gone, then becomes the server. A launcher rather than a
# preexec_fn: Python code between fork and exec (here a dlopen) can deadlock the child of a process with
# threads, a Ray actor's gRPC ones among them, and Popen then waits for that child's exec forever.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def kill_with_parent(command: Sequence[str]) -> list[str]:
    """`command` run so that it is SIGKILLed when the thread that started it ends: a launched server never
    outlives the actor or run that started it."""
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


@dataclass
class ServerProcess:
    """An engine server's subprocess (SGLang's or vLLM's); `stop()` (or leaving a `with`) ends it."""

    process: subprocess.Popen
    url: str
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(command: Sequence[str], url: str, name: str, *, timeout_s: float, die_with_parent: bool,
                 env: Mapping[str, str] | None = None, cwd: str | None = None) -> ServerProcess:
    """Runs `command` (its log to a temp file) and waits until `url`/health answers 200; an EngineError quoting
    the log's tail if it exits or stays unhealthy for `timeout_s`. `die_with_parent`: `kill_with_parent`."""
    with tempfile.NamedTemporaryFile(prefix=f"{name.split()[0].lower()}-", suffix=".log", delete=False) as log:
        argv = kill_with_parent(command) if die_with_parent else list(command)
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    server = ServerProcess(process, url, Path(log.name))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise EngineError(f"{name} exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    server.stop()
    raise EngineError(f"{name} at {url} was not healthy within {timeout_s} s:\n{server.log_tail()}")
