"""Each server's bounds on one request and on its connections, in one place.

The engine's come from `ServerLimits` (its command line sets them); the others are fixed here, sized to what their
requests carry."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class Bounds:
    """What one server accepts: `Guard` enforces the body cap, `GuardedH11Protocol` the read deadline and the
    connection cap (past it, the oldest idle connection is closed)."""

    #: largest request body, checked against Content-Length and again as the body arrives
    max_body_bytes: int
    #: a request's header and body must arrive within this of its first byte (uvicorn has no such deadline)
    read_timeout_s: float
    #: connections served at once
    max_connections: int


#: `relax-gym env-server`: a step's action is text (media only flow out)
ENV_SERVER = Bounds(max_body_bytes=4 * MIB, read_timeout_s=30.0, max_connections=1024)
#: the agent proxy: an agent's whole history, images inline as data URLs, every call
AGENT_PROXY = Bounds(max_body_bytes=64 * MIB, read_timeout_s=30.0, max_connections=1024)
#: a run's control API: small JSON bodies from an operator or a script
CONTROL_API = Bounds(max_body_bytes=1 * MIB, read_timeout_s=10.0, max_connections=64)
