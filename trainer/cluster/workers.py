"""The rollout workers: actors that play groups, and the controller-side pool that hands them tasks.

A task's group comes back by value as the call's result, so the controller owns it the moment it exists and a
worker dying afterwards cannot take it along (an ObjectRef owned by the worker would raise OwnerDiedError). A
worker that dies with tasks in flight loses only those calls: each task is played again at once on a live
worker (the front of the queue), and the data bus counted it as started once, so it is neither skipped nor
trained twice. A dead worker is recreated within its restart budget.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from relax_gym.engines.base import Engine
from relax_gym.errors import RunStopped
from relax_gym.trainer.cluster.budget import RestartBudget
from relax_gym.trainer.cluster.placement import settled
from relax_gym.trainer.cluster.ray_handles import ACTOR_GONE, call
from relax_gym.trainer.cluster.roles import RolloutWorker
from relax_gym.trainer.config import TrainConfig
from relax_gym.trajectory import Trajectory

START_TIMEOUT_S = 300.0


@dataclass
class WorkerSlot:
    worker_id: str
    actor: Any
    #: recreations of this worker: the budget's window and the run total
    restarts: RestartBudget
    inflight: int = 0
    alive: bool = False
    #: dead with its restart budget spent: never recreated
    retired: bool = False
    incarnation: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    node_id: str | None = None  # where its current actor runs


class WorkerPool:
    """M rollout-worker actors; `run_group` is the loop's `run_task` transport."""

    def __init__(self, cfg: TrainConfig, *, engines: Callable[[], tuple[int, dict[str, Engine]]],
                 event: Callable[..., None], faults: dict[str, dict[str, int]] | None = None):
        assert cfg.cluster is not None
        self.cfg = cfg
        self.cluster = cfg.cluster
        self._engines = engines
        self._event = event
        self.slots: dict[str, WorkerSlot] = {}
        self._live = asyncio.Condition()
        self.lost_calls = 0  # group calls a dead worker took with it (each played again elsewhere)
        #: engine failovers counted by workers since replaced (a run total must not shrink when one dies)
        self.failovers_of_lost = 0
        #: faults to inject by worker id into its first incarnation (tests, chaos runs): {"exit_after_s": s}
        self.faults = dict(faults or {})
        self._recreating: set[asyncio.Task] = set()

    def _spawn(self, worker_id: str) -> Any:
        """A worker actor; `_bring_up` gives it the engines once it is ready."""
        actor: Any = ray.remote(RolloutWorker).options(
            num_cpus=self.cluster.rollout_workers.num_cpus, resources=self.cluster.rollout_workers.resources,
            max_restarts=0, max_task_retries=0, max_concurrency=1000,
            scheduling_strategy="SPREAD",  # CPU work: over every node, next to no engine in particular
        ).remote(worker_id, self.cfg, engine_wait_s=self.cluster.health.engine_wait_s)
        return actor

    async def _bring_up(self, slot: WorkerSlot) -> None:
        try:
            slot.node_id = (await asyncio.wait_for(call(slot.actor.ready), START_TIMEOUT_S))["node_id"]
        except TimeoutError:
            raise TimeoutError(f"rollout worker {slot.worker_id} did not start within {START_TIMEOUT_S:g} s") from None
        await call(slot.actor.set_engines, *self._engines())  # as they are now, however long it took to start
        async with self._live:
            slot.alive = True
            self._live.notify_all()
        fault = self.faults.pop(slot.worker_id, None)
        if fault and "exit_after_s" in fault:
            asyncio.get_running_loop().call_later(fault["exit_after_s"], ray.kill, slot.actor)

    async def start(self, count: int) -> None:
        for i in range(count):
            wid = f"rollout-{i}"
            h = self.cluster.health
            self.slots[wid] = WorkerSlot(wid, self._spawn(wid), RestartBudget(h.worker_restarts, h.restart_window_s))
        await asyncio.gather(*(self._bring_up(s) for s in self.slots.values()))

    async def set_engines(self, epoch: int, members: dict[str, Engine]) -> None:
        """Every live worker routes over these engines from now on."""
        await asyncio.gather(*(call(s.actor.set_engines, epoch, members) for s in self.slots.values() if s.alive),
                             return_exceptions=True)  # a dead worker learns them when it is recreated

    async def adopt_adapter(self, folder: str, version: int) -> None:
        """Every live worker's requests name the run's adapter of `version` from now on (a recreated worker learns
        it with its engines: the fleet's clients, which loaded it)."""
        await asyncio.gather(*(call(s.actor.adopt_adapter, folder, version) for s in self.slots.values() if s.alive),
                             return_exceptions=True)

    async def _pick(self) -> WorkerSlot:
        async with self._live:
            await self._live.wait_for(lambda: any(s.alive for s in self.slots.values())
                                      or all(s.retired for s in self.slots.values()))
            live = [s for s in self.slots.values() if s.alive]
            if not live:
                h = self.cluster.health
                raise RunStopped(f"every rollout worker died and their restart budget (cluster.health."
                                 f"worker_restarts={h.worker_restarts} per {h.restart_window_s:g} s) is spent")
            return min(live, key=lambda s: (s.inflight, s.worker_id))

    async def _run(self, method: str, *args: Any) -> list[Trajectory]:
        """The call on the least-loaded live worker; played again elsewhere if that worker dies meanwhile."""
        while True:
            slot = await self._pick()
            incarnation = slot.incarnation
            slot.inflight += 1
            try:
                result: list[Trajectory] = await call(getattr(slot.actor, method), *args)
                return result
            except ACTOR_GONE as err:  # played again at once on a live worker, while this one is recreated
                self.lost_calls += 1
                if slot.incarnation == incarnation:
                    self.lost(slot.worker_id, f"{type(err).__name__} during {method}")
            finally:
                slot.inflight -= 1

    async def run_group(self, env_id: str, seed: int, group_size: int,
                        env_kwargs: dict[str, Any]) -> list[Trajectory]:
        return await self._run("run_group", env_id, seed, group_size, env_kwargs)

    async def run_eval(self, env_id: str, n_tasks: int, seed: int, env_kwargs: dict[str, Any]) -> list[Trajectory]:
        return await self._run("run_eval", env_id, n_tasks, seed, env_kwargs)

    def lost(self, worker_id: str, reason: str) -> None:
        """A worker died or stalled: no task goes to it from now on; it is killed and recreated in the
        background, within its budget. No live worker left and no budget to make one stops the run."""
        slot = self.slots[worker_id]
        if not slot.alive:
            return  # already being replaced (or retired)
        slot.alive = False
        slot.incarnation += 1
        self.failovers_of_lost += int(slot.stats.get("failovers", 0))
        slot.stats = {}
        ray.kill(slot.actor)
        job = asyncio.create_task(self._recreate(slot, reason))
        self._recreating.add(job)
        job.add_done_callback(self._recreating.discard)

    async def _recreate(self, slot: WorkerSlot, reason: str) -> None:
        """A new actor for the slot, tried again (within the budget) if it is lost as it starts."""
        worker_id = slot.worker_id
        started = time.monotonic()
        while True:
            if not slot.restarts.spend():
                self._event("worker_dead", worker_id=worker_id, reason=reason, note="restart budget spent")
                await self._retire(slot)
                return
            await settled([slot.node_id] if slot.node_id else [])  # SPREAD must not choose a node going down
            slot.actor = self._spawn(worker_id)
            try:
                await self._bring_up(slot)
                break
            except (*ACTOR_GONE, TimeoutError) as err:
                self._event("worker_restart_failed", worker_id=worker_id, reason=f"{type(err).__name__}: {err}")
                ray.kill(slot.actor)
        self._event("worker_restarted", worker_id=worker_id, reason=reason,
                    time_to_recover_s=round(time.monotonic() - started, 3))

    async def _retire(self, slot: WorkerSlot) -> None:
        async with self._live:
            slot.retired = True
            self._live.notify_all()  # a task waiting for a live worker learns there may be none

    async def shutdown(self) -> None:
        for job in list(self._recreating):
            job.cancel()
        await asyncio.gather(*self._recreating, return_exceptions=True)
        for slot in self.slots.values():
            ray.kill(slot.actor)
