"""The engine fleet: the controller's registry of engine actors, and weight publication to them.

An engine serves only once it holds the published weights: it is created (STARTING), answers (HEALTH_CHECKING),
loads the last published state dict (WEIGHT_SYNCING, under the publication lock, so no publication can slip
past it) and only then becomes ACTIVE and visible to the routers. `published_version` is the version every
ACTIVE engine acknowledged; an engine that fails a publication is DEAD (and replaced by the health manager),
so it never serves a version older than the others. Publication, recovery and scale operations take one lock.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from relax_gym.engines.base import Engine, EngineError
from relax_gym.engines.pushed_adapters import KEEP_ADAPTERS
from relax_gym.engines.router import MEMBER_OUTAGE_TIMEOUT_S, MEMBER_RETRIES
from relax_gym.engines.sglang import SGLangEngine
from relax_gym.engines.vllm import VLLMEngine
from relax_gym.trainer.cluster.budget import RestartBudget
from relax_gym.trainer.cluster.config import ClusterSection
from relax_gym.trainer.cluster.placement import engine_bundles, in_group, nodes_of, release, reserve, settled
from relax_gym.trainer.cluster.ray_handles import ACTOR_GONE, RayEngineClient, WeightsLost, call, source_lost
from relax_gym.trainer.cluster.roles import EngineService, ServerSupervisor, pushed_adapters
from relax_gym.trainer.cluster.scale import EngineState, EngineView
from relax_gym.trainer.config import TrainConfig

#: how long a new engine may take to build its model and answer (and one weight load)
START_TIMEOUT_S = 300.0
#: engines seen only through their HTTP routes (an external server, an SGLang process): no progress view, so
#: they are probed every poll, and they load weights through their own routes
OUTSIDE_VIEW = ("http", "sglang", "vllm")
#: weight folders kept by the disk strategy: the newest (for joining engines) and the one before
KEEP_FOLDERS = 2


class EngineStartError(EngineError):
    """An engine could not be started, checked or synced; the message says which step failed."""


@dataclass
class EngineSlot:
    """One engine: `actor` is None for an external server registered by URL (`kind` http)."""

    engine_id: str
    kind: str  # embedded | serve | sglang | vllm | http
    actor: Any
    client: Engine | None  # None until its actor exists
    state: EngineState
    initial: bool
    url: str | None = None
    #: the engine's placement group (None for an external server, or before its first start)
    group: Any = None
    added_at: float = field(default_factory=time.time)
    version: int = -1
    #: dead with its restart budget spent: never recreated
    retired: bool = False
    #: recreations of this slot: the budget's window and the run total (set by the fleet from the config)
    restarts: RestartBudget = field(default_factory=lambda: RestartBudget(0, 0.0))
    stats: dict[str, Any] = field(default_factory=dict)


class ActorFleet:
    """The `EngineFleet` of engine actors: creates, syncs, publishes to, drains and removes them, and tells the
    routers which are ACTIVE.

    `on_change(epoch, members)` is awaited after every change of the ACTIVE set (the worker pool forwards it
    to every rollout worker); `event(kind, **fields)` records what happened (the run's event log).
    """

    def __init__(self, cfg: TrainConfig, *, on_change: Callable[[int, dict[str, Engine]], Awaitable[None]],
                 event: Callable[..., None], status: Callable[[], dict[str, Any]] | None = None,
                 faults: dict[str, dict[str, int]] | None = None, api_key: str = "",
                 distribute: Callable[[list[Engine], bool], Awaitable[int]] | None = None):
        assert cfg.cluster is not None
        self.cfg = cfg
        self.cluster: ClusterSection = cfg.cluster
        self.min_engines = self.cluster.health.min_engines
        self.slots: dict[str, EngineSlot] = {}
        self.lock = asyncio.Lock()
        self.epoch = 0
        #: what a joining engine loads: the last published state dict's ObjectRef, or folder (disk), or
        #: "distributed" (the trainer sends its weights through a group of the joiner's own); None before any
        self.published: Any = None
        self.published_version = 0
        self._next_id = 0
        self._on_change = on_change
        self._event = event
        self._status = status or (lambda: {})
        #: faults to inject by engine id, given to that engine's first incarnation only (tests, chaos runs)
        self.faults = dict(faults or {})
        #: the bearer token of served engines (`kind: serve`); external servers get $RELAX_GYM_API_KEY's
        self.api_key = api_key
        #: the disk strategy's folders, oldest first (the newest is what a joining engine loads)
        self.folders: deque[Path] = deque()
        #: the run's LoRA adapters each server keeps loaded, where pushes are adapters (`pushed_adapters`)
        self.keep_adapters = adapters[1] if (adapters := pushed_adapters(cfg)) else KEEP_ADAPTERS
        #: the distributed strategy: broadcasts the trainer's weights to these servers (their HTTP clients, each
        #: with its own key; alone: to a joining one through a group of its own), returning the version sent
        self.distribute = distribute

    # --- views ------------------------------------------------------------------------
    def active(self) -> dict[str, Engine]:
        return {i: s.client for i, s in self.slots.items() if s.state == "ACTIVE" and s.client is not None}

    def engines(self) -> list[EngineView]:
        return [EngineView(engine_id=s.engine_id, kind=s.kind, url=s.url, state=s.state, version=s.version,
                           inflight=int(s.stats.get("inflight", 0)), served=int(s.stats.get("done", 0)),
                           initial=s.initial, added_at=s.added_at)
                for s in self.slots.values() if s.state != "REMOVED"]

    def status(self) -> dict[str, Any]:
        return {**self._status(), "published_version": self.published_version, "engine_epoch": self.epoch}

    async def _changed(self) -> None:
        self.epoch += 1
        await self._on_change(self.epoch, self.active())

    # --- creating ---------------------------------------------------------------------
    async def _spawn(self, slot: EngineSlot) -> None:
        """A new actor for `slot`, in the slot's placement group (reserved on its first start and kept across
        restarts, so a restarted engine lands on the same node and GPUs)."""
        c = self.cluster.engines
        if slot.group is None:
            slot.group = await reserve(engine_bundles(self.cluster), "STRICT_PACK", START_TIMEOUT_S,
                                       f"engine {slot.engine_id}")
        options: dict[str, Any] = {"num_cpus": c.num_cpus, "num_gpus": c.num_gpus * c.tp, "resources": c.resources,
                                   "max_restarts": 0, "max_task_retries": 0, "max_concurrency": 1000,
                                   **in_group(slot.group)}
        fault = self.faults.pop(slot.engine_id, None)
        if slot.kind in ("sglang", "vllm"):
            slot.actor = ray.remote(ServerSupervisor).options(**options).remote(slot.engine_id, self.cfg)
        else:
            slot.actor = ray.remote(EngineService).options(**options).remote(slot.engine_id, self.cfg, fault)
        slot.client = RayEngineClient(slot.engine_id, slot.actor)
        slot.url = None

    async def _bring_up(self, slot: EngineSlot, on_state: Callable[[EngineState], None] | None) -> None:
        """STARTING -> HEALTH_CHECKING -> WEIGHT_SYNCING -> ACTIVE; raises EngineStartError (the actor killed)."""

        def enter(state: EngineState) -> None:
            slot.state = state
            if on_state is not None:
                on_state(state)

        step = "STARTING"
        try:
            enter("STARTING")
            if slot.kind == "http":
                assert slot.client is not None
                await asyncio.wait_for(slot.client.connect(), START_TIMEOUT_S)
            else:
                await self._spawn(slot)
                await asyncio.wait_for(call(slot.actor.ready), START_TIMEOUT_S)
                if slot.kind in ("serve", "sglang", "vllm"):
                    slot.url = await call(slot.actor.serve_http, self._host(), self.api_key)
                    slot.client = member_client(slot.url, self.api_key, slot.kind, self.keep_adapters)
            step = "HEALTH_CHECKING"
            enter("HEALTH_CHECKING")
            # its first token, cold (first-call allocations and kernels): part of starting, not a stall probe
            if not await asyncio.wait_for(self.probe(slot), START_TIMEOUT_S):
                raise EngineStartError("its probe failed")
            step = "WEIGHT_SYNCING"
            enter("WEIGHT_SYNCING")
            await asyncio.wait_for(self._sync(slot, enter), START_TIMEOUT_S)
        except asyncio.CancelledError:
            self._end(slot)
            slot.state = "DEAD"
            raise
        except Exception as err:
            self._end(slot)
            slot.state = "DEAD"
            why = "timed out" if isinstance(err, TimeoutError) else f"{type(err).__name__}: {err}"
            raise EngineStartError(f"engine {slot.engine_id} failed at {step}: {why}") from None

    async def _sync(self, slot: EngineSlot, enter: Callable[[EngineState], None]) -> None:
        """The published weights into a starting engine, then ACTIVE. If they cannot be fetched (their trainer
        rank's node is gone), it waits for the next publication, which the restarted trainer makes."""
        while True:
            async with self.lock:  # no publication slips past: the engine gets exactly the published version
                published = self.published
                try:
                    if published is None:
                        slot.version = self.published_version  # nothing published yet: the initial weights
                    elif self.distribute is not None:
                        assert slot.client is not None
                        slot.version = await self.distribute([slot.client], True)
                    else:
                        slot.version = await self._load(slot, published, self.published_version)
                except Exception as err:
                    if not source_lost(err):
                        raise
                else:
                    enter("ACTIVE")
                    await self._changed()
                    return
            while self.published is published:
                await asyncio.sleep(0.1)

    def _host(self) -> str:
        """Where served engines listen: the configured host, else loopback on a local cluster and this node's
        address on a joined one (rollout workers may run on other nodes)."""
        if self.cluster.engines.host:
            return self.cluster.engines.host
        return ray.util.get_node_ip_address() if self.cluster.address else "127.0.0.1"

    @staticmethod
    def _end(slot: EngineSlot, *, release_group: bool = False) -> None:
        """Kills the slot's actor (its reservation is kept for a restart unless `release_group`)."""
        if slot.actor is not None:
            ray.kill(slot.actor)
        if release_group:
            release(slot.group)
            slot.group = None

    async def probe(self, slot: EngineSlot) -> bool:
        """One greedy token from an engine actor; /health from a server seen only over HTTP (SGLang's generates a
        token)."""
        if slot.kind in OUTSIDE_VIEW:
            assert slot.client is not None
            return await slot.client.health()
        return bool(await call(slot.actor.probe))

    async def _load(self, slot: EngineSlot, weights: Any, version: int) -> int:
        """`weights` (an object-store ref or a folder) into one engine; returns the version it then holds."""
        if slot.kind in OUTSIDE_VIEW:
            assert slot.client is not None
            await slot.client.update_weights(weights, version)
            return version
        return int(await call(slot.actor.update_weights, weights, version))

    async def add_engine(self, url: str | None = None,
                         on_state: Callable[[EngineState], None] | None = None) -> str:
        """A new engine actor, or the external server at `url`, synced to the published weights before it is
        routable; returns its id."""
        if url is not None and self.cluster.weight_sync == "object_store":
            raise EngineStartError(f"registering the external server {url} needs cluster.weight_sync=disk (a "
                                   "shared file system it loads weights from) or distributed (it joins the "
                                   "trainer's group); this run publishes through Ray's object store")
        engine_id = f"engine-{self._next_id}" if url is None else f"ext-{self._next_id}"
        self._next_id += 1
        if url is None:
            h = self.cluster.health
            slot = EngineSlot(engine_id, self.cluster.engines.kind, None, None, "STARTING",
                              initial=not self.slots and not self.published,
                              restarts=RestartBudget(h.engine_restarts, h.restart_window_s))
        else:
            # its own key: $RELAX_GYM_API_KEY (read here, where the operator set it), never the served engines'
            slot = EngineSlot(engine_id, "http", None, member_client(url, None, self.cluster.engines.kind,
                                                                   self.keep_adapters),
                              "STARTING", initial=False, url=url.rstrip("/"))
        self.slots[engine_id] = slot
        started = time.monotonic()
        try:
            await self._bring_up(slot, on_state)
        except BaseException:
            self._end(slot, release_group=True)  # a scale-out that failed gives back what it reserved,
            slot.state = "REMOVED"  # and is not the health manager's to revive
            if slot.kind == "http" and slot.client is not None:
                await slot.client.close()
            raise
        self._event("engine_added", engine_id=engine_id, ready_s=round(time.monotonic() - started, 3),
                    version=slot.version)
        return engine_id

    async def start(self, count: int) -> None:
        """The run's initial engines, concurrently; any that fails to start stops the run before it trains."""
        results = await asyncio.gather(*(self.add_engine() for _ in range(count)), return_exceptions=True)
        for slot in self.slots.values():
            slot.initial = True
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def replace(self, engine_id: str, reason: str) -> bool:
        """Kills a dead or stuck engine and brings up a fresh one in its slot (same id), if the slot's restart
        budget (`cluster.health.engine_restarts` per `restart_window_s`) allows; False when it does not (the slot
        stays DEAD)."""
        slot = self.slots[engine_id]
        was_active = slot.state == "ACTIVE"
        slot.state = "DEAD"
        if was_active:
            await self._changed()  # routers stop choosing it now; its in-flight calls fail over when it dies
        if slot.kind == "http":  # an external server is not ours to restart
            slot.retired = True
            self._event("engine_dead", engine_id=engine_id, reason=reason, url=slot.url, note="external server")
            return False
        ray.kill(slot.actor)
        if not slot.restarts.spend():
            slot.retired = True
            self._event("engine_dead", engine_id=engine_id, reason=reason, restarts=slot.restarts.total,
                        note="restart budget spent")
            return False
        delay = min(2.0 ** (slot.restarts.in_window - 1) - 1, 30.0)  # 0, 1, 3, 7 ... s
        started = time.monotonic()
        await asyncio.gather(asyncio.sleep(delay), settled(nodes_of(slot.group)))  # not onto a node that is going down
        try:
            await self._bring_up(slot, None)
        except EngineStartError as err:
            self._event("engine_restart_failed", engine_id=engine_id, reason=str(err))
            return False
        self._event("engine_restarted", engine_id=engine_id, reason=reason,
                    time_to_recover_s=round(time.monotonic() - started, 3), version=slot.version)
        return True

    # --- publishing -------------------------------------------------------------------
    async def publish(self, weights: ray.ObjectRef | dict[str, torch.Tensor] | Path | None, version: int) -> int:
        """`weights` at `version` to every ACTIVE engine: a state dict (or its ObjectRef) goes through the object
        store (one copy for all), a folder is loaded from disk (older folders are pruned, the newest kept for
        joining engines), None means the trainer rank broadcasts its own (`distribute`). Returns how many
        acknowledged. An engine that fails is DEAD (the health manager replaces it); the others go on. WeightsLost when
        an engine could not fetch them (their maker's node is gone): nothing is published, no engine is blamed."""
        async with self.lock:
            slots = [s for s in self.slots.values() if s.state == "ACTIVE"]
            published: Any = weights
            results: list[Any]
            if weights is None:
                published = "distributed"
                results = await self._distribute_to(slots, version)
            else:
                if isinstance(weights, Path):
                    self.folders.append(weights)
                elif not isinstance(weights, ray.ObjectRef):
                    published = ray.put(weights)
                results = await asyncio.gather(
                    *(asyncio.wait_for(self._load(s, published, version), START_TIMEOUT_S) for s in slots),
                    return_exceptions=True)
            # an engine that could not fetch the weights is fine: it keeps what it holds until the trainer is back
            lost = [r for r in results if isinstance(r, BaseException) and source_lost(r)]
            if not lost:
                self.published, self.published_version = published, version
            while len(self.folders) > KEEP_FOLDERS:
                shutil.rmtree(self.folders.popleft(), ignore_errors=True)
            failed = False
            for slot, result in zip(slots, results, strict=True):
                if isinstance(result, BaseException) and not source_lost(result):
                    slot.state = "DEAD"
                    failed = True
                    gone = isinstance(result, ACTOR_GONE)
                    self._event("publish_failed", engine_id=slot.engine_id, version=version,
                                reason="engine gone" if gone else f"{type(result).__name__}: {result}")
                elif not isinstance(result, BaseException):
                    slot.version = int(result)
            if failed:
                await self._changed()
            if lost:
                cause = getattr(lost[0], "cause", lost[0])
                raise WeightsLost(f"no engine could fetch the weights of version {version} ({type(cause).__name__}): "
                                  "the trainer rank's node is gone")
            return sum(not isinstance(r, BaseException) for r in results)

    async def _distribute_to(self, slots: list[EngineSlot], version: int) -> list[Any]:
        """One broadcast to every slot; if it fails, the engines that no longer answer are left out and it is
        tried once more with the others. Each slot's result: the version it acknowledged, or the error."""
        assert self.distribute is not None
        error: Exception = EngineError("no engine took the weights")
        members = list(slots)
        for _ in range(2):
            if not members:
                break
            try:
                sent = await self.distribute([s.client for s in members if s.client is not None], False)
            except EngineError as err:  # a lost trainer (TrainerLost) is the controller's to handle, not ours
                error = err
                answers = await asyncio.gather(*(asyncio.wait_for(self.probe(s), self.cluster.health.probe_timeout_s)
                                                 for s in members), return_exceptions=True)
                members = [s for s, ok in zip(members, answers, strict=True) if ok is True]
                continue
            return [sent if s in members else error for s in slots]
        return [error for _ in slots]

    # --- shrinking --------------------------------------------------------------------
    async def drain_engine(self, engine_id: str, timeout_s: float) -> int:
        """Routers stop choosing the engine (sticky episodes move at their next turn); waits up to `timeout_s`
        for its in-flight requests; returns how many were left."""
        slot = self.slots[engine_id]
        async with self.lock:
            slot.state = "DRAINING"
            await self._changed()
        deadline = time.monotonic() + timeout_s
        while slot.kind not in OUTSIDE_VIEW:  # a server seen only from outside is given the whole timeout
            try:
                stats = await asyncio.wait_for(call(slot.actor.stats), 10.0)
            except (*ACTOR_GONE, TimeoutError):
                return 0
            slot.stats = stats
            if stats["inflight"] == 0 or time.monotonic() >= deadline:
                return int(stats["inflight"])
            await asyncio.sleep(0.05)
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        return 0

    async def remove_engine(self, engine_id: str) -> None:
        """Ends the engine: what it still runs fails over in the routers. REMOVED is never revived."""
        slot = self.slots[engine_id]
        was_active = slot.state == "ACTIVE"
        slot.state = "REMOVED"
        if was_active:
            async with self.lock:
                await self._changed()
        self._end(slot, release_group=True)
        self._event("engine_removed", engine_id=engine_id)

    async def shutdown(self) -> None:
        for slot in self.slots.values():
            if slot.state != "REMOVED":
                self._end(slot, release_group=True)
            if slot.kind == "http" and slot.client is not None:
                await slot.client.close()


def member_client(url: str, api_key: str | None, kind: str = "sglang",
                  keep_adapters: int = KEEP_ADAPTERS) -> SGLangEngine | VLLMEngine:
    """A router member for an engine server: a short outage budget, so a dead server fails over at once (the
    router's own wait bounds the whole outage). `api_key` None: $RELAX_GYM_API_KEY. A vLLM client for
    `kind` "vllm" (the run's engines, and servers registered by URL in such a run), else an SGLang one;
    `keep_adapters`: the run's pushed LoRA adapters it keeps loaded."""
    if kind == "vllm":
        return VLLMEngine(url, outage_timeout_s=MEMBER_OUTAGE_TIMEOUT_S, retries=MEMBER_RETRIES, api_key=api_key,
                          keep_adapters=keep_adapters)
    return SGLangEngine(url, outage_timeout_s=MEMBER_OUTAGE_TIMEOUT_S, retries=MEMBER_RETRIES, max_connections=None,
                        api_key=api_key, keep_adapters=keep_adapters)
