"""uvicorn under a server's bounds, blocking (a command's whole process) or inside a running event loop.

In a loop, the socket is bound before uvicorn starts: a taken port is an `OSError` to the caller (uvicorn would
`sys.exit`), and a free port asked for with port 0 is never let go and taken again (no race with another process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from relax_gym.web.address import url_of
from relax_gym.web.bounds import Bounds
from relax_gym.web.guard import protocol_class

logger = logging.getLogger("relax_gym.web")


class NoQueryInAccessLog(logging.Filter):
    """Drops the query string from uvicorn's access lines: no route reads one, but a client that sends its key
    as `?api_key=...` would otherwise leave it in the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) == 5 and isinstance(record.args[2], str):
            path = record.args[2]
            if "?" in path:
                record.args = (*record.args[:2], path.split("?", 1)[0] + "?<query not logged>", *record.args[3:])
        return True


ACCESS_FILTER = NoQueryInAccessLog()


def uvicorn_config(app: Any, host: str, port: int, bounds: Bounds, *, drain_timeout_s: float = 5.0,
                   **kwargs: Any) -> uvicorn.Config:
    """uvicorn's settings for `app` under `bounds`: the read deadline, the connection cap, the SIGTERM drain, and
    access lines without query strings."""
    config = uvicorn.Config(app, host=host, port=port,
                            http=protocol_class(bounds.read_timeout_s, bounds.max_connections), timeout_keep_alive=5,
                            timeout_graceful_shutdown=math.ceil(drain_timeout_s), **kwargs)
    logging.getLogger("uvicorn.access").addFilter(ACCESS_FILTER)  # after the config set up uvicorn's logging
    return config


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


class LoopServer(uvicorn.Server):
    """uvicorn inside a running event loop, without its signal handlers: Ctrl-C and SIGTERM belong to the process
    hosting it (the training run, an engine actor), not to the server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class InLoopServer:
    """Serves `app` with uvicorn as a task of the running event loop, on `host`:`port` (0: a free one).

    `start` returns the URL once it accepts connections; `stop` ends it (requests in flight get a few seconds).
    Used by the control API (in the driver's loop), an engine actor's HTTP server and the agent proxy (in the
    rollout's loop)."""

    def __init__(self, app: Any, bounds: Bounds, host: str = "127.0.0.1", port: int = 0, *, name: str = "server",
                 start_timeout_s: float = 10.0) -> None:
        self.app, self.bounds, self.host, self.port, self.name = app, bounds, host, port, name
        self.start_timeout_s = start_timeout_s
        self._server: LoopServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError(f"the {self.name} is not started")
        return self._url

    def running_here(self) -> bool:
        """Whether it serves, as a task of the running loop (a server of a finished loop is gone with it)."""
        task = self._task
        return task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop()

    async def start(self) -> str:
        """Binds, serves, and returns the URL (with the real port when `port` was 0)."""
        if self._task is not None:
            raise RuntimeError(f"the {self.name} is already started")
        sock = bind_listener(self.host, self.port)
        bound_host, port = sock.getsockname()[:2]
        # log_config=None: uvicorn's records go through the host process's logging, not handlers of its own
        config = uvicorn_config(self.app, self.host, port, self.bounds, log_level="warning", log_config=None,
                                access_log=False, lifespan="off")
        server = self._server = LoopServer(config)

        async def serve() -> None:
            try:
                await server.serve(sockets=[sock])
            except SystemExit as err:  # uvicorn's way to report a startup failure: never the host's exit
                raise RuntimeError(f"the {self.name} did not start (uvicorn exited with {err.code})") from None
            finally:
                sock.close()

        loop = asyncio.get_running_loop()
        self._task = loop.create_task(serve(), name=f"relax_gym {self.name}")
        deadline = loop.time() + self.start_timeout_s
        while not server.started:
            if self._task.done():
                self._task.result()  # its error
                raise RuntimeError(f"the {self.name} stopped while starting")
            if loop.time() > deadline:
                await self.stop()
                raise RuntimeError(f"the {self.name} did not start within {self.start_timeout_s:g} s")
            await asyncio.sleep(0.01)
        self._url = url_of(bound_host, port)
        return self._url

    async def stop(self) -> None:
        """Stops serving, if it serves on this loop (requests in flight get a few seconds); idempotent."""
        server, task = self._server, self._task
        self._server = self._task = None
        self._url = None
        if server is None or task is None:
            return
        server.should_exit = True
        if task.done() or task.get_loop() is not asyncio.get_running_loop():
            return
        done, _ = await asyncio.wait({task}, timeout=5.0)
        if not done:
            server.force_exit = True
            task.cancel()
            await asyncio.wait({task})
