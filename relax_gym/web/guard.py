"""What stands between a server and the network: the bearer key, the body cap, the read deadline.

Two layers, each where it can act earliest (the bounds are a server's `Bounds`):
- `Guard` (ASGI middleware): the bearer key on every route but the server's open ones (liveness, model info),
  and the body cap, both answered before a byte of the body is parsed; the body is read here, so a client that
  sends more than it announced (or announces nothing) is cut off at the cap.
- `GuardedH11Protocol` (uvicorn's HTTP/1.1 protocol plus one timer and one cap): a request whose header and body
  have not fully arrived within `read_timeout_s` of its first byte, or a connection that sends nothing at all, is
  closed. uvicorn has no such timeout: a client that sends half a header holds its connection forever. Past
  `max_connections`, the oldest connection with no request under way is closed to let the new one in: a flood of
  idle sockets cannot lock the operator or the health probe out (uvicorn's `limit_concurrency` counts idle sockets
  and answers everyone 503).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Iterable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from relax_gym.web.errors import error_response


class Guard:
    """ASGI middleware: the bearer key (except on `open_routes`), then the body, read whole up to the cap.

    `api_key=None` turns authentication off (only for a port no one else can reach). `key_hint` says, in the 401,
    where the client finds the key; `cap_hint`, in the 413, what sets the cap. A refused request's body is not
    read by the app: uvicorn discards the rest as it arrives (no memory held, bounded by the read deadline), so
    the client reads the refusal instead of a reset
    connection."""

    def __init__(self, app: Any, *, api_key: str | None, max_body_bytes: int, open_routes: Iterable[str] = (),
                 key_hint: str = "the key the server was started with", cap_hint: str = "") -> None:
        self.app = app
        self._key = None if api_key is None else api_key.encode()
        self.max_body_bytes = max_body_bytes
        self.open_routes = frozenset(open_routes)
        self.key_hint = key_hint
        self.cap_hint = cap_hint

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self._key is not None and scope["path"] not in self.open_routes and not self._authorized(headers):
            message = f"missing or wrong API key: send 'Authorization: Bearer <key>' ({self.key_hint})"
            await error_response(401, message, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit():
            await error_response(400, "content-length: not a number")(scope, receive, send)
            return
        if int(declared) > self.max_body_bytes:
            await error_response(413, self._too_large(int(declared)))(scope, receive, send)
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                await error_response(413, self._too_large(len(body)))(scope, receive, send)
                return
        await self.app(scope, _replay(bytes(body), receive), send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key or b"")

    def _too_large(self, size: int) -> str:
        hint = f" ({self.cap_hint})" if self.cap_hint else ""
        return f"request body: {size} bytes is over the server's limit of {self.max_body_bytes}{hint}"


def _replay(body: bytes, receive: Any) -> Any:
    """A `receive` that gives the buffered body once, then waits on the real one (for the disconnect)."""
    given = False

    async def replay() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's arrival (header and body).

    Armed when the connection opens and when the first bytes of the next request on a kept-alive
    connection arrive; disarmed once h11 has seen the request's end. If it fires first, the
    connection is closed (a request already being handled sees a disconnect)."""

    read_timeout_s: float  # set by `protocol_class`
    max_connections: int  # likewise

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._opened = self.loop.time()
        self._arm()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def _idle(self) -> bool:
        """No request under way: none has begun arriving, or the last one was answered."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _make_room(self) -> None:
        """Closes the oldest idle connections (never this one) until the cap holds; with none idle, this one."""
        idle = sorted((c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                       and c._idle() and not c.transport.is_closing()), key=lambda c: c._opened)
        excess = len(self.connections) - self.max_connections
        for victim in idle[:excess]:
            victim.transport.close()
        if excess > len(idle):
            self.logger.warning("%d connections are open and none is idle (max_connections): closed a new one",
                                len(self.connections) - 1)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _read_timed_out(self) -> None:
        self._deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.logger.info("closed a connection whose request did not arrive within %g s", self.read_timeout_s)
            self.transport.close()


def protocol_class(read_timeout_s: float, max_connections: int) -> type[GuardedH11Protocol]:
    """`GuardedH11Protocol` with its deadline and cap bound (uvicorn builds protocols from a class)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"read_timeout_s": read_timeout_s, "max_connections": max_connections})
