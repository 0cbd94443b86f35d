"""The health manager: finds dead and stuck roles from progress, and spends a bounded budget replacing them.

Death is what Ray says (a call on the actor raises `RayActorError`). A stall is work in flight and no
completion for `stall_s`, measured by the role's own counters, never by a heartbeat a side thread could keep
beating while the role is stuck. Suspect engines are probed in parallel (one greedy token each, bounded by
`probe_timeout_s`). The rules that decide what to kill are pure functions (`engines_to_replace`), tested apart.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from typing import Any

from relax_gym.trainer.cluster.config import HealthSection
from relax_gym.trainer.cluster.fleet import OUTSIDE_VIEW, ActorFleet, EngineSlot
from relax_gym.trainer.cluster.ray_handles import ACTOR_GONE, call
from relax_gym.trainer.cluster.workers import WorkerPool


def engines_to_replace(failed: list[str], active: int, max_kill_fraction: float) -> tuple[list[str], str | None]:
    """Which engines that failed their probe this round to kill: at most max(1, fraction x active) of them, and
    none when more than half of several engines failed at once (then the fault is likelier ours: the network, the
    controller, an overloaded node; killing them would turn a hiccup into an outage). Returns (victims, why none)."""
    if not failed:
        return [], None
    if active > 1 and len(failed) > active / 2:
        return [], (f"{len(failed)} of {active} engines failed their probe at once: killing none, "
                    "backing off (a fault on the controller's side would otherwise kill every engine)")
    return sorted(failed)[: max(1, math.floor(max_kill_fraction * active))], None


def is_stalled(stats: dict[str, Any], stall_s: float) -> bool:
    """Work in flight and nothing finished for `stall_s`."""
    return int(stats.get("inflight", 0)) > 0 and float(stats.get("idle_s", 0.0)) > stall_s


class HealthMonitor:
    """Polls engines and workers every `poll_s`; replaces the dead and the stuck within their budgets."""

    def __init__(self, fleet: ActorFleet, workers: WorkerPool, health: HealthSection, *, episode_timeout_s: float,
                 event: Callable[..., None]):
        self.fleet = fleet
        self.workers = workers
        self.h = health
        #: an episode may legitimately run this long, so a worker's groups may too
        self.worker_stall_s = health.stall_s + episode_timeout_s
        self._event = event
        self.probe_failures = 0
        self.cascades = 0
        self._backoff_rounds = 0
        self._repairs: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.h.poll_s)
            await self.check_engines()
            await self.check_workers()

    async def _stats(self, actor: Any) -> dict[str, Any] | BaseException:
        try:
            stats: dict[str, Any] = await asyncio.wait_for(call(actor.stats), self.h.probe_timeout_s)
            return stats
        except (*ACTOR_GONE, TimeoutError) as err:
            return err

    async def _answers(self, slot: EngineSlot) -> bool:
        """The engine's probe, bounded by `probe_timeout_s`: a timeout or an error is a failed probe."""
        try:
            return await asyncio.wait_for(self.fleet.probe(slot), self.h.probe_timeout_s)
        except Exception:
            return False
    async def check_engines(self) -> None:
        watched = [s for s in self.fleet.slots.values() if s.state in ("ACTIVE", "DRAINING")]
        outside = [s for s in watched if s.kind in OUTSIDE_VIEW]  # no progress view: their answers are the test
        answers = await asyncio.gather(*(self._answers(s) for s in outside))
        dead = [s.engine_id for s, ok in zip(outside, answers, strict=True) if not ok]
        slots = [s for s in watched if s.kind not in OUTSIDE_VIEW]
        results = await asyncio.gather(*(self._stats(s.actor) for s in slots))
        suspects = []
        for slot, result in zip(slots, results, strict=True):
            if isinstance(result, ACTOR_GONE):
                dead.append(slot.engine_id)
            elif isinstance(result, BaseException) or is_stalled(result, self.h.stall_s):
                suspects.append(slot)  # stats that time out are as suspect as a stall
            else:
                slot.stats = result
        if self._backoff_rounds:
            self._backoff_rounds -= 1
            suspects = []
        probes = await asyncio.gather(*(self._answers(s) for s in suspects))
        failed = [s.engine_id for s, ok in zip(suspects, probes, strict=True) if not ok]
        self.probe_failures += len(failed)
        for engine_id in failed:
            self._event("probe_failed", engine_id=engine_id)
        active = sum(s.state == "ACTIVE" for s in slots)
        victims, why = engines_to_replace(failed, active, self.h.max_kill_fraction)
        if why:
            self.cascades += 1
            self._backoff_rounds = min(2 ** self.cascades, 32)
            self._event("anti_cascade", failed=failed, note=why)
        # dead ones: found now, or marked DEAD elsewhere (a failed publication, a failed restart)
        dead += [i for i, s in self.fleet.slots.items() if s.state == "DEAD" and not s.retired]
        for engine_id in dead:
            self._repair(engine_id, "died")
        for engine_id in victims:
            self._repair(engine_id, f"stalled for more than {self.h.stall_s:g} s and failed its probe")

    def _repair(self, engine_id: str, reason: str) -> None:
        """Replaces the engine in the background (one repair per engine at a time)."""
        if engine_id in self._repairs or self.fleet.slots[engine_id].state in ("REMOVED", "DRAINING"):
            return
        self._event("engine_lost", engine_id=engine_id, reason=reason)
        self._background(engine_id, self.fleet.replace(engine_id, reason))

    def _background(self, role_id: str, repair: Coroutine[Any, Any, Any]) -> None:
        """Runs a repair without holding up the polling (one per role at a time)."""
        if role_id in self._repairs:
            repair.close()
            return
        job = asyncio.create_task(repair)
        self._repairs[role_id] = job
        job.add_done_callback(lambda _: self._repairs.pop(role_id, None))

    async def check_workers(self) -> None:
        slots = [s for s in self.workers.slots.values() if s.alive]
        results = await asyncio.gather(*(self._stats(s.actor) for s in slots))
        for slot, result in zip(slots, results, strict=True):
            if isinstance(result, ACTOR_GONE):
                self.workers.lost(slot.worker_id, "died")
            elif isinstance(result, BaseException) or is_stalled(result, self.worker_stall_s):
                self.workers.lost(slot.worker_id, f"no group finished for {self.worker_stall_s:g} s")
            else:
                slot.stats = result

    async def close(self) -> None:
        for job in list(self._repairs.values()):
            job.cancel()
        await asyncio.gather(*self._repairs.values(), return_exceptions=True)
