"""An httpx transport that spreads generation requests over several connection pools and keeps control
calls apart.

httpcore's pool walks all of its connections on every request it queues and every response it releases
(`_assign_requests_to_connections`; encode/httpx#3215, encode/httpcore#1035), so one pool serving N
concurrent requests costs O(N²): at 512 concurrent requests to `relax-gym serve`
(`benchmarks/serve_path.py`) the client spent most of its CPU there and starved the server it shared the
machine with. K pools of N/K connections, taken in turn, cost O(N²/K). Written here because httpx has no
such option and the linear pools are not in a stable release yet; remove it once httpcore's pool is linear.
"""

from __future__ import annotations

import itertools

import httpx

#: pools per client: beyond ~32 connections each the bookkeeping shows; 16 keeps 512 concurrent requests there
SHARDS = 16
#: the route whose requests are many and long; the rest are control calls
GENERATE_ROUTE = "/generate"


class ShardedTransport(httpx.AsyncBaseTransport):
    """/generate requests over `shards` `httpx.AsyncHTTPTransport`s, each to the next in turn, and every other
    route over a pool of its own.

    `max_connections` (None: unlimited) caps the generation pools together, split between them and rounded
    down. The control routes never wait behind generation: with a capped pool full of requests that a paused
    server holds, the /continue_generation that would release them could otherwise never be sent."""

    def __init__(self, max_connections: int | None = None, shards: int = SHARDS) -> None:
        if max_connections is not None:  # the cap holds in all: at most one pool per connection allowed
            shards = max(1, min(shards, max_connections))
        per_shard = None if max_connections is None else max_connections // shards
        limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        self._pools = [httpx.AsyncHTTPTransport(limits=limits) for _ in range(shards)]
        self._turn = itertools.cycle(self._pools)
        self._control = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        pool = next(self._turn) if request.url.path == GENERATE_ROUTE else self._control
        return await pool.handle_async_request(request)

    async def aclose(self) -> None:
        for pool in [*self._pools, self._control]:
            await pool.aclose()
