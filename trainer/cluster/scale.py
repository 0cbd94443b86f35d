"""Scaling the rollout engines in and out while a run trains: the fleet the controller exposes, and the operations.

`EngineFleet` is what the controller (in the driver) implements; `ScaleManager` turns an operator's request into
one operation at a time, run as an asyncio task, with a record anyone can poll. Nothing here knows HTTP: the
control API (`control_api`) maps `ScaleRejected.status` to its answer.

Operations, and the states their records go through:
- scale_out: PENDING -> STARTING -> COMPLETED | FAILED | CANCELLED. The engines start concurrently; each one's
  own state (the fleet's STARTING -> HEALTH_CHECKING -> WEIGHT_SYNCING -> ACTIVE) is in the record's `progress`.
  A partial success is COMPLETED with `failed` (and `error`) set: the engines that came up serve, and the operator
  sees what did not; FAILED means none came up.
- scale_in: PENDING -> DRAINING -> REMOVING -> COMPLETED | FAILED (FAILED: no victim could be removed).
Only a scale-out may be cancelled, and only while PENDING or STARTING: a drain half done is not worth undoing.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

logger = logging.getLogger("relax_gym.trainer.cluster")

EngineState = Literal["STARTING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "ACTIVE", "DRAINING", "DEAD", "REMOVED"]
OpKind = Literal["scale_out", "scale_in"]
OpState = Literal["PENDING", "STARTING", "DRAINING", "REMOVING", "COMPLETED", "FAILED", "CANCELLED"]

RUNNING_STATES: frozenset[str] = frozenset({"PENDING", "STARTING", "DRAINING", "REMOVING"})
TERMINAL_STATES: frozenset[str] = frozenset({"COMPLETED", "FAILED", "CANCELLED"})
CANCELLABLE_STATES: frozenset[str] = frozenset({"PENDING", "STARTING"})
#: how long one engine may take to become ACTIVE, unless the request says (a cold model load plus a weight sync)
DEFAULT_START_TIMEOUT_S = 300.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0
#: the longest start or drain timeout a request may ask for: a scale-in cannot be cancelled, so this bounds how long
#: one can hold the manager (every other request is 409 meanwhile)
MAX_TIMEOUT_S = 3600.0
#: operation records kept (the oldest finished ones go first)
MAX_OPS = 100
MAX_IDEMPOTENCY_KEY = 200


@dataclass
class EngineView:
    """One engine as the controller sees it, at the moment `EngineFleet.engines` was called."""

    engine_id: str
    kind: str  # "embedded" (a Ray actor), "http" (an external URL)
    url: str | None
    state: EngineState
    version: int  # weight version loaded
    inflight: int
    served: int
    initial: bool  # started with the run (vs added by scale-out)
    added_at: float  # time.time() when added (LIFO order for scale-in)


class EngineFleet(Protocol):
    """The controller's side: the engines of a run, and the three changes an operator can make to them."""

    min_engines: int

    def engines(self) -> list[EngineView]:
        """Every engine not REMOVED."""
        ...

    def status(self) -> dict[str, Any]:
        """Run status (step, versions, bus counters): returned as is by /v1/status."""
        ...

    async def add_engine(self, url: str | None = None, on_state: Callable[[EngineState], None] | None = None) -> str:
        """Creates an engine (url None) or registers an external server at `url`; takes it through STARTING ->
        HEALTH_CHECKING -> WEIGHT_SYNCING -> ACTIVE (calling on_state at each), and returns its id once ACTIVE
        (synced to the published weight version). Raises an Exception with a readable message on failure
        (having cleaned up). If cancelled (asyncio.CancelledError) it cleans up and re-raises."""
        ...

    async def drain_engine(self, engine_id: str, timeout_s: float) -> int:
        """Stops routing new turns to the engine (state DRAINING), waits up to timeout_s for its in-flight
        requests to finish; returns how many were still in flight when it stopped waiting (0 = drained)."""
        ...

    async def remove_engine(self, engine_id: str) -> None:
        """Shuts the engine down (in-flight requests are aborted; routers fail them over); state REMOVED."""
        ...


class ScaleRejected(ValueError):
    """A request the manager will not act on; `status` is the HTTP answer (400 bad, 404 unknown op, 409 busy)."""

    def __init__(self, message: str, status: int = 400, running_op_id: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.running_op_id = running_op_id


@dataclass
class ScaleOp:
    """One operation's record, as `/v1/ops/{op_id}` shows it (`to_dict`).

    `engine_ids`: the engines it acted on successfully (scale-out: those that became ACTIVE; scale-in: those
    removed). `failed`: `{engine_id, url, error}` per engine that did not (plus `slot` for a scale-out engine that
    never got an id). `progress`: each engine's latest state. `aborted` (scale-in): requests still in flight when
    each victim was removed (after its drain timed out, or all of them under `force`)."""

    op_id: str
    kind: OpKind
    request: dict[str, Any]
    state: OpState = "PENDING"
    engine_ids: list[str] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    version_on_activate: dict[str, int] = field(default_factory=dict)
    progress: list[dict[str, Any]] = field(default_factory=list)
    aborted: dict[str, int] = field(default_factory=dict)
    idempotency_key: str | None = None

    def set_state(self, state: OpState) -> None:
        logger.info("scale op %s (%s): %s -> %s", self.op_id, self.kind, self.state, state)
        self.state = state
        self.touch()

    def touch(self) -> None:
        self.updated_at = time.time()

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(asdict(self))


@dataclass(frozen=True)
class ScaleResult:
    """What a scale request did: `started` a new operation (`record` is its record), or not (`record` is a NOOP or
    DRY_RUN answer, or the earlier operation an Idempotency-Key names)."""

    record: dict[str, Any]
    started: bool


def live(engines: list[EngineView]) -> list[EngineView]:
    """The engines that count toward a target: neither DEAD nor REMOVED."""
    return [e for e in engines if e.state not in ("DEAD", "REMOVED")]


def _normal_url(url: str) -> str:
    return url.strip().rstrip("/")


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class ScaleManager:
    """Runs the operators' scale requests on `fleet`, one operation at a time.

    Call its methods from the event loop the fleet lives in (the control API does). `max_engines` caps a scale-out
    target, so a typo (100 for 10) is refused rather than asking the cluster for 100 engines."""

    def __init__(self, fleet: EngineFleet, *, max_engines: int | None = None, max_ops: int = MAX_OPS) -> None:
        self.fleet = fleet
        self.max_engines = max_engines
        self.max_ops = max_ops
        self._ops: OrderedDict[str, ScaleOp] = OrderedDict()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._keys: dict[str, str] = {}  # Idempotency-Key -> op_id

    # --- reading -----------------------------------------------------------------------------------------------

    def ops(self) -> list[dict[str, Any]]:
        """Every kept record, newest first."""
        return [op.to_dict() for op in reversed(self._ops.values())]

    def op(self, op_id: str) -> dict[str, Any]:
        return self._get(op_id).to_dict()

    def running_op_id(self) -> str | None:
        """The operation whose task has not finished (a cancelled scale-out counts until the fleet cleaned up)."""
        return next((op_id for op_id, task in self._tasks.items() if not task.done()), None)

    async def wait(self, op_id: str) -> dict[str, Any]:
        """The record once the operation has finished (for callers in the same process, e.g. tests, autoscalers)."""
        self._get(op_id)
        task = self._tasks.get(op_id)
        if task is not None:
            await asyncio.wait({task})
            self._finalize(self._ops[op_id], task)
        return self.op(op_id)

    # --- scale-out ---------------------------------------------------------------------------------------------

    async def scale_out(
        self,
        num_engines: int | None = None,
        engine_urls: list[str] | None = None,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> ScaleResult:
        """Grows the fleet to `num_engines` live engines (an absolute target, not a delta), or registers the
        external servers at `engine_urls` (those already registered are skipped). Returns at once; the engines
        start concurrently, each given `timeout_s` (default 300 s) to become ACTIVE."""
        request = {"num_engines": num_engines, "engine_urls": None if engine_urls is None else list(engine_urls),
                   "timeout_s": timeout_s}
        if (replay := self._replay(idempotency_key, "scale_out", request)) is not None:
            return replay
        if (num_engines is None) == (engine_urls is None):
            raise ScaleRejected("give exactly one of num_engines (a target count) or engine_urls")
        if timeout_s is not None and not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ScaleRejected(f"timeout_s: seconds, more than 0 and at most {MAX_TIMEOUT_S:g}, got {timeout_s}")
        self._check_idle()
        engines = live(self.fleet.engines())
        slots: list[str | None]
        if num_engines is not None:
            if num_engines < 1:
                raise ScaleRejected(f"num_engines: the target count must be at least 1, got {num_engines}")
            if self.max_engines is not None and num_engines > self.max_engines:
                raise ScaleRejected(f"num_engines: {num_engines} is over this run's maximum of {self.max_engines} "
                                    "engines (max_engines)")
            if num_engines <= len(engines):
                return self._noop(f"the run has {len(engines)} live engines, the target is {num_engines}", request)
            slots = [None] * (num_engines - len(engines))
        else:
            assert engine_urls is not None
            urls = list(dict.fromkeys(_normal_url(u) for u in engine_urls))
            bad = [u for u in urls if urlsplit(u).scheme not in ("http", "https") or not urlsplit(u).netloc]
            if not urls or bad:
                raise ScaleRejected(f"engine_urls: expected http(s)://host:port URLs, got {bad or engine_urls}")
            known = {_normal_url(e.url) for e in engines if e.url}
            slots = [u for u in urls if u not in known]
            if not slots:
                return self._noop("every URL in engine_urls is already registered", request)
            if self.max_engines is not None and len(engines) + len(slots) > self.max_engines:
                raise ScaleRejected(f"engine_urls: {len(slots)} more engines would make {len(engines) + len(slots)}, "
                                    f"over this run's maximum of {self.max_engines} (max_engines)")
        op = self._new_op("scale_out", request, idempotency_key)
        op.progress = [{"slot": i, "url": url, "engine_id": None, "state": "PENDING"} for i, url in enumerate(slots)]
        self._launch(op, self._run_scale_out(op, timeout_s or DEFAULT_START_TIMEOUT_S))
        return ScaleResult(op.to_dict(), started=True)

    async def _run_scale_out(self, op: ScaleOp, timeout_s: float) -> None:
        op.set_state("STARTING")
        await asyncio.gather(*(self._start_one(op, entry, timeout_s) for entry in op.progress))
        self._conclude(op, f"{len(op.progress)} engines")

    async def _start_one(self, op: ScaleOp, entry: dict[str, Any], timeout_s: float) -> None:
        def on_state(state: EngineState) -> None:
            entry["state"] = state
            op.touch()

        try:
            engine_id = await asyncio.wait_for(self.fleet.add_engine(entry["url"], on_state=on_state), timeout_s)
        except TimeoutError:
            self._fail(op, entry, f"not ACTIVE within {timeout_s:g} s (timeout_s); it was {entry['state']}")
            return
        except Exception as err:
            self._fail(op, entry, _error(err))
            return
        entry.update(engine_id=engine_id, state="ACTIVE")
        op.engine_ids.append(engine_id)
        view = next((e for e in self.fleet.engines() if e.engine_id == engine_id), None)
        if view is not None:
            op.version_on_activate[engine_id] = view.version
        op.touch()

    # --- scale-in ----------------------------------------------------------------------------------------------

    async def scale_in(
        self,
        num_engines: int | None = None,
        engine_ids: list[str] | None = None,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        force: bool = False,
        dry_run: bool = False,
        idempotency_key: str | None = None,
    ) -> ScaleResult:
        """Shrinks the fleet to `num_engines` live engines (the newest ACTIVE ones go first), or removes
        `engine_ids`; never below `fleet.min_engines`. Each victim first stops taking turns and gets
        `drain_timeout_s` to finish its requests (no wait under `force`); what is still in flight is aborted (the
        routers fail it over). `dry_run` answers which engines would go and changes nothing (allowed while another
        operation runs)."""
        request = {"num_engines": num_engines, "engine_ids": None if engine_ids is None else list(engine_ids),
                   "drain_timeout_s": drain_timeout_s, "force": force}
        if not dry_run and (replay := self._replay(idempotency_key, "scale_in", request)) is not None:
            return replay
        if (num_engines is None) == (engine_ids is None):
            raise ScaleRejected("give exactly one of num_engines (a target count) or engine_ids")
        if not 0 <= drain_timeout_s <= MAX_TIMEOUT_S:
            raise ScaleRejected(f"drain_timeout_s: seconds, 0 to {MAX_TIMEOUT_S:g}, got {drain_timeout_s}")
        minimum = self.fleet.min_engines
        if not dry_run:
            self._check_idle()
        every = self.fleet.engines()
        engines = live(every)
        if num_engines is not None:
            if num_engines < minimum:
                raise ScaleRejected(f"num_engines: {num_engines} is below this run's minimum (min_engines: "
                                    f"{minimum})")
            if num_engines >= len(engines):
                return self._noop(f"the run has {len(engines)} live engines, the target is {num_engines}", request)
            active = sorted((e for e in engines if e.state == "ACTIVE"), key=lambda e: e.added_at, reverse=True)
            excess = len(engines) - num_engines
            if len(active) < excess:
                raise ScaleRejected(f"num_engines: reaching {num_engines} means removing {excess} engines, but only "
                                    f"{len(active)} are ACTIVE (the others are starting or draining): retry later "
                                    "or name engine_ids")
            victims = active[:excess]
        else:
            assert engine_ids is not None
            ids = list(dict.fromkeys(engine_ids))
            by_id = {e.engine_id: e for e in every}
            unknown = [i for i in ids if i not in by_id]
            if not ids or unknown:
                raise ScaleRejected(f"engine_ids: unknown engines {unknown} (GET /v1/engines lists them)" if unknown
                                    else "engine_ids: empty")
            victims = [by_id[i] for i in ids]
            remaining = len(engines) - sum(v.state not in ("DEAD", "REMOVED") for v in victims)
            if remaining < minimum:
                raise ScaleRejected(f"engine_ids: removing them would leave {remaining} live, below this run's "
                                    f"minimum (min_engines: {minimum})")
        if dry_run:
            return ScaleResult({"state": "DRY_RUN", "engine_ids": [v.engine_id for v in victims],
                                "victims": [asdict(v) for v in victims],
                                "remaining": len(engines) - sum(v.state != "DEAD" for v in victims),
                                "request": request}, started=False)
        op = self._new_op("scale_in", request, idempotency_key)
        op.progress = [{"engine_id": v.engine_id, "state": v.state} for v in victims]
        self._launch(op, self._run_scale_in(op, victims, drain_timeout_s, force))
        return ScaleResult(op.to_dict(), started=True)

    async def _run_scale_in(self, op: ScaleOp, victims: list[EngineView], timeout_s: float, force: bool) -> None:
        op.set_state("DRAINING")
        entries = {entry["engine_id"]: entry for entry in op.progress}
        await asyncio.gather(*(self._drain_one(op, entries[v.engine_id], v, timeout_s, force) for v in victims))
        op.set_state("REMOVING")
        await asyncio.gather(*(self._remove_one(op, entries[v.engine_id]) for v in victims))
        self._conclude(op, f"{len(victims)} engines")

    async def _drain_one(self, op: ScaleOp, entry: dict[str, Any], victim: EngineView, timeout_s: float,
                         force: bool) -> None:
        """Drains an ACTIVE (or already DRAINING) victim; an engine in another state has nothing to drain. A drain
        that fails is recorded and the engine is removed anyway: the operator asked for it to go."""
        engine_id = victim.engine_id
        if force or victim.state not in ("ACTIVE", "DRAINING"):
            current = next((e for e in self.fleet.engines() if e.engine_id == engine_id), victim)
            op.aborted[engine_id] = current.inflight
            return
        entry["state"] = "DRAINING"
        op.touch()
        try:
            op.aborted[engine_id] = await self.fleet.drain_engine(engine_id, timeout_s)
        except Exception as err:
            op.failed.append({"engine_id": engine_id, "url": victim.url, "error": f"drain: {_error(err)}"})
            current = next((e for e in self.fleet.engines() if e.engine_id == engine_id), victim)
            op.aborted[engine_id] = current.inflight
        op.touch()

    async def _remove_one(self, op: ScaleOp, entry: dict[str, Any]) -> None:
        engine_id = entry["engine_id"]
        try:
            await self.fleet.remove_engine(engine_id)
        except Exception as err:
            entry["state"] = "FAILED"
            op.failed.append({"engine_id": engine_id, "url": None, "error": f"remove: {_error(err)}"})
        else:
            entry["state"] = "REMOVED"
            op.engine_ids.append(engine_id)
        op.touch()

    # --- cancel ------------------------------------------------------------------------------------------------

    async def cancel(self, op_id: str, wait_s: float = 30.0) -> dict[str, Any]:
        """Cancels a PENDING or STARTING scale-out; the fleet stops and cleans up the engines still starting (those
        already ACTIVE stay: scale in to remove them). Waits up to `wait_s` for that cleanup, so the record
        returned is normally CANCELLED; past it, the record is returned as it is and turns CANCELLED later."""
        op = self._get(op_id)
        task = self._tasks.get(op_id)
        if op.state not in CANCELLABLE_STATES or task is None or task.done():
            raise ScaleRejected(f"operation {op_id} is {op.state}: only a scale-out still PENDING or STARTING can be "
                                "cancelled", status=409, running_op_id=self.running_op_id())
        logger.info("scale op %s: cancel requested", op_id)
        task.cancel()
        await asyncio.wait({task}, timeout=wait_s)
        if task.done():
            self._finalize(op, task)
        return op.to_dict()

    # --- bookkeeping -------------------------------------------------------------------------------------------

    def _get(self, op_id: str) -> ScaleOp:
        if op_id not in self._ops:
            raise ScaleRejected(f"no operation {op_id!r} (GET /v1/ops lists the last {self.max_ops})", status=404)
        return self._ops[op_id]

    def _check_idle(self) -> None:
        if (running := self.running_op_id()) is not None:
            op = self._ops[running]
            raise ScaleRejected(f"operation {running} ({op.kind}, {op.state}) is still running: wait for it to "
                                "finish (or cancel it, if it is a scale-out still starting)", status=409,
                                running_op_id=running)

    def _replay(self, key: str | None, kind: OpKind, request: dict[str, Any]) -> ScaleResult | None:
        """The operation an Idempotency-Key already started, so a retried request does not start a second one."""
        if key is None:
            return None
        if not key or len(key) > MAX_IDEMPOTENCY_KEY:
            raise ScaleRejected(f"Idempotency-Key: 1 to {MAX_IDEMPOTENCY_KEY} characters")
        op_id = self._keys.get(key)
        if op_id is None:
            return None
        op = self._ops[op_id]
        if op.kind != kind or op.request != request:
            raise ScaleRejected(f"Idempotency-Key {key!r} was already used for a different request (operation "
                                f"{op_id}): use a new key for a new request")
        return ScaleResult(op.to_dict(), started=False)

    def _noop(self, why: str, request: dict[str, Any]) -> ScaleResult:
        return ScaleResult({"state": "NOOP", "detail": why, "request": request}, started=False)

    def _new_op(self, kind: OpKind, request: dict[str, Any], key: str | None) -> ScaleOp:
        op = ScaleOp(op_id=f"op-{secrets.token_hex(6)}", kind=kind, request=request, idempotency_key=key)
        self._ops[op.op_id] = op
        if key is not None:
            self._keys[key] = op.op_id
        finished = [i for i, o in self._ops.items() if o.state in TERMINAL_STATES]
        for old in finished[: max(0, len(self._ops) - self.max_ops)]:
            gone = self._ops.pop(old)
            self._tasks.pop(old, None)
            if gone.idempotency_key is not None:
                self._keys.pop(gone.idempotency_key, None)
        logger.info("scale op %s (%s) requested: %s", op.op_id, kind, request)
        return op

    def _launch(self, op: ScaleOp, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work, name=f"relax_gym {op.op_id}")
        self._tasks[op.op_id] = task
        task.add_done_callback(lambda t: self._finalize(op, t))

    def _finalize(self, op: ScaleOp, task: asyncio.Task[None]) -> None:
        """The record's end when the task did not write it: cancelled (possibly before it ran), or a bug."""
        if op.state in TERMINAL_STATES:
            return
        if task.cancelled():
            for entry in op.progress:
                if entry["state"] not in ("ACTIVE", "FAILED"):
                    entry["state"] = "CANCELLED"
            op.error = "cancelled by request" + (f"; {len(op.engine_ids)} engines already ACTIVE stay"
                                                 if op.engine_ids else "")
            op.set_state("CANCELLED")
        elif (err := task.exception()) is not None:
            logger.error("scale op %s failed unexpectedly", op.op_id, exc_info=err)
            op.error = f"internal error: {_error(err)}"
            op.set_state("FAILED")

    def _fail(self, op: ScaleOp, entry: dict[str, Any], error: str) -> None:
        entry["state"] = "FAILED"
        op.failed.append({"engine_id": entry.get("engine_id"), "url": entry.get("url"), "slot": entry.get("slot"),
                          "error": error})
        op.touch()

    def _conclude(self, op: ScaleOp, asked: str) -> None:
        """COMPLETED if any engine made it (with `failed` and `error` naming the rest), else FAILED."""
        if op.failed:
            op.error = f"{len(op.failed)} failures (of {asked}); first: {op.failed[0]['error']}"
            logger.warning("scale op %s: %s", op.op_id, op.error)
        op.set_state("COMPLETED" if op.engine_ids else "FAILED")
