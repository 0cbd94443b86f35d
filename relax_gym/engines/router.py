"""`EngineRouter`: several engines behind one `Engine`, so the rollout manager drives a fleet unchanged.

Why worker-side: the rollout manager already owns each episode and its exact token prefix,
so routing next to it needs no extra hop and can fail over without losing anything. Each
`GenerateRequest` carries the whole prefix (`rid = "<group>/<member>/<turn>"`), so re-sending
the same request object to another engine is exact: the episode goes on as if nothing happened
(only that turn's sampling is redrawn).

- Sticky episodes: the routing key is the rid without its last `/turn`, so every turn of an
  episode goes to the engine that holds its prefix in cache, while that engine is a member and
  up. New episodes (and rid None) go to the member with the fewest requests in flight (ties by
  name). The sticky map is an LRU (`MAX_EPISODES` keys): episodes end without telling the router.
- Failover: an outage of a member (`EngineUnavailableError`, which `EngineGoneError` is,
  `httpx.TransportError`, `OSError`) marks it down for `retry_down_after_s` (then it is tried
  again: a restarted server comes back), re-sticks the episode elsewhere and re-sends the same
  request. A `RequestError` (a 4xx) is the request's fault: another engine would refuse it too,
  so it is re-raised, as is any other error (a bug or a bad answer is not an outage).
- No member up: the call waits (woken by `set_members` or by a down mark expiring) for up to
  `wait_s` from the moment it first found none, then raises `EngineUnavailableError`, which the
  rollout manager records as an aborted episode ("engine unavailable ...").

It depends on nothing but the `Engine` protocol (no Ray): a controller keeps the member set
current with `set_members`. Call it from the event loop's thread, as every other method.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from relax_gym.engines.base import Engine, EngineUnavailableError, GenerateOutput, GenerateRequest, RequestError

__all__ = ["EngineRouter"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: with `engine_urls`, how long one server's call waits out its outage, and how often it retries, before the
#: router marks it down and re-sends the request to another server (the router's own wait, `rollout.
#: engine_outage_timeout_s`, bounds the outage of all of them)
MEMBER_OUTAGE_TIMEOUT_S = 2.0
MEMBER_RETRIES = 1

#: what makes a member down (and the request go to another one); everything else is re-raised
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (EngineUnavailableError, httpx.TransportError, OSError)


@dataclass
class _Member:
    """One engine under one name, with its counters (a new engine object under the name gets a new record)."""

    name: str
    engine: Engine
    inflight: int = 0
    served: int = 0
    failures: int = 0
    down_until: float = 0.0  # time.monotonic() until which it is skipped; 0 = up

    def up(self, now: float) -> bool:
        return now >= self.down_until


def episode_key(rid: str | None) -> str | None:
    """The episode a request belongs to: its rid without the last `/turn` part (None: no episode)."""
    if rid is None:
        return None
    return rid.rsplit("/", 1)[0] if "/" in rid else rid


class EngineRouter:
    """Several engines as one `Engine`: sticky episodes, least-loaded placement, exact re-send on an outage.

    `members` maps a name to an engine (`set_members` replaces the set later). `wait_s` bounds how long a
    request waits while no member is up; `retry_down_after_s` how long a failed member is skipped.
    `close()` closes every member the router holds at that moment; members dropped by `set_members` are
    the caller's to close.
    """

    #: how many episodes' engines are remembered (least recently used forgotten first)
    MAX_EPISODES = 100_000

    def __init__(self, members: Mapping[str, Engine] | None = None, *, wait_s: float = 300.0,
                 retry_down_after_s: float = 5.0) -> None:
        if wait_s < 0 or retry_down_after_s < 0:
            raise ValueError(f"wait_s and retry_down_after_s must be >= 0, got {wait_s}, {retry_down_after_s}")
        self.wait_s = wait_s
        self.retry_down_after_s = retry_down_after_s
        #: requests re-sent to another member after an outage, in total
        self.failovers = 0
        self._members: dict[str, _Member] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._waiters: list[asyncio.Future[None]] = []
        self.set_members(members or {})

    # --- membership ------------------------------------------------------------------------

    def set_members(self, members: Mapping[str, Engine]) -> None:
        """Makes `members` the routable set. A name given with the same engine object keeps its record (and down
        mark); a new object under a name starts up, with the name's `served`/`failures` counts carried on.
        Episodes stuck to a dropped member move at their next turn; its requests in flight finish there."""
        old = self._members
        fresh: dict[str, _Member] = {}
        for name, engine in members.items():
            record = old.get(name)
            if record is None or record.engine is not engine:
                carried = (record.served, record.failures) if record is not None else (0, 0)
                record = _Member(name, engine, served=carried[0], failures=carried[1])
            fresh[name] = record
        self._members = fresh
        self._wake()

    @property
    def members(self) -> dict[str, Engine]:
        """The routable engines by name (a copy)."""
        return {name: m.engine for name, m in self._members.items()}

    def stats(self) -> dict[str, Any]:
        """`{"failovers": int, "episodes": int, "members": {name: {inflight, served, failures, down}}}`."""
        now = time.monotonic()
        return {
            "failovers": self.failovers,
            "episodes": len(self._sticky),
            "members": {name: {"inflight": m.inflight, "served": m.served, "failures": m.failures,
                               "down": not m.up(now)} for name, m in self._members.items()},
        }

    # --- the Engine protocol -----------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        """The oldest version among the members that are up (0 if none): what a new request may be sampled with."""
        now = time.monotonic()
        return min((m.engine.weight_version for m in self._members.values() if m.up(now)), default=0)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sends `request` to its episode's engine; on an outage, to another one (the same request object)."""
        key = episode_key(request.rid)
        none_since: float | None = None
        last_error = ""
        resend = False
        while True:
            member = self._pick(key)
            if member is None:
                now = time.monotonic()
                none_since = now if none_since is None else none_since
                left = self.wait_s - (now - none_since)
                if left <= 0:
                    raise EngineUnavailableError(
                        f"no live engine for {self.wait_s:g}s (members: {self._describe()})"
                        + (f"; last error: {last_error}" if last_error else ""))
                await self._wait_for_change(left)
                continue
            if resend:
                self.failovers += 1
            member.inflight += 1
            try:
                out = await member.engine.generate(request)
            except OUTAGE_ERRORS as err:
                last_error = f"{member.name}: {type(err).__name__}: {err}"
                self._mark_down(member, err, "generate")
                resend = True
                continue
            finally:
                member.inflight -= 1
            member.served += 1
            return out

    async def update_weights(self, weights: Any, version: int) -> None:
        """Every member loads the weights. A member that fails is marked down (it serves again, on whatever weights
        it has, once its mark expires: its outputs say which version); the error is raised only if none
        succeeded, so one dead engine does not stop training."""
        await self._broadcast("update_weights", lambda e: e.update_weights(weights, version))

    async def pause(self) -> None:
        """Pauses every member (a failing one is marked down; raises only if none paused)."""
        await self._broadcast("pause", lambda e: e.pause())

    async def resume(self) -> None:
        """Resumes every member (a failing one is marked down; raises only if none resumed)."""
        await self._broadcast("resume", lambda e: e.resume())

    async def connect(self) -> dict[str, Any]:
        """Connects every member; needs one to succeed (the others are marked down, their errors logged).
        Returns the first successful member's answer, plus `members`: the names that connected."""
        results = await self._broadcast("connect", lambda e: e.connect())
        first = next(iter(results.values()))
        return {**first, "members": sorted(results)}

    async def health(self) -> bool:
        """True if any member is healthy."""
        async def one(engine: Engine) -> bool:
            try:
                return await engine.health()
            except Exception:  # a health probe answers, it does not raise
                return False

        return any(await asyncio.gather(*(one(m.engine) for m in self._members.values())))

    async def close(self) -> None:
        """Closes every member held now and empties the set (waiting requests then time out)."""
        members, self._members = self._members, {}
        self._sticky.clear()
        await asyncio.gather(*(m.engine.close() for m in members.values()), return_exceptions=True)

    # --- internals -----------------------------------------------------------------------------

    def _pick(self, key: str | None) -> _Member | None:
        """The episode's member if it is still a member and up; else the least loaded member up (re-stuck)."""
        now = time.monotonic()
        if key is not None and (name := self._sticky.get(key)) is not None:
            member = self._members.get(name)
            if member is not None and member.up(now):
                self._sticky.move_to_end(key)
                return member
        live = [m for m in self._members.values() if m.up(now)]
        if not live:
            return None
        member = min(live, key=lambda m: (m.inflight, m.name))
        if key is not None:
            self._sticky[key] = member.name
            self._sticky.move_to_end(key)
            while len(self._sticky) > self.MAX_EPISODES:
                self._sticky.popitem(last=False)
        return member

    def _mark_down(self, member: _Member, err: BaseException, what: str) -> None:
        member.failures += 1
        was_up = member.up(time.monotonic())
        member.down_until = time.monotonic() + self.retry_down_after_s
        if was_up:
            logger.warning("engine %s failed %s (%s: %s); skipping it for %g s", member.name, what,
                           type(err).__name__, err, self.retry_down_after_s)

    def _describe(self) -> str:
        now = time.monotonic()
        return ", ".join(f"{n} {'up' if m.up(now) else 'down'}" for n, m in self._members.items()) or "none"

    async def _wait_for_change(self, left: float) -> None:
        """Sleeps until `set_members`, the next down mark's expiry, or `left` seconds, whichever comes first."""
        now = time.monotonic()
        expiries = [m.down_until - now for m in self._members.values() if m.down_until > now]
        timeout = min([left, *expiries])
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait([waiter], timeout=max(timeout, 0.0))
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            waiter.cancel()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _broadcast(self, what: str, call: Callable[[Engine], Awaitable[T]]) -> dict[str, T]:
        """`call` on every member at once; the results of those that succeeded. A failing member is marked down
        (unless it raised `RequestError`: the call was bad, not the engine), and one that answered is up again;
        raises the first error if none succeeded (EngineUnavailableError if there are no members)."""
        members = list(self._members.values())
        if not members:
            raise EngineUnavailableError(f"{what}: the router has no engines")
        outcomes = await asyncio.gather(*(call(m.engine) for m in members), return_exceptions=True)
        results: dict[str, T] = {}
        errors: list[BaseException] = []
        for member, outcome in zip(members, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):  # cancellation, KeyboardInterrupt: never swallowed
                    raise outcome
                errors.append(outcome)
                if isinstance(outcome, RequestError):  # the call's fault, not the engine's: it stays up
                    member.failures += 1
                else:
                    self._mark_down(member, outcome, what)
            else:
                results[member.name] = outcome
                if not member.up(time.monotonic()):
                    member.down_until = 0.0  # it answered: serve again at once
                    self._wake()
        if not results:
            raise errors[0]
        return results
