"""The data bus between rollouts and the trainer, and the staleness guarantee.

Policy version v = optimizer steps taken. A group's staleness when consumed at
version v is `v - min(version of any generated token in it)`. `max_staleness = k`
is kept by admission control: a new group may start only while
`started - discarded < (v + k + 1) * groups_per_step`, so nothing is generated
only to be thrown away; groups that are discarded anyway (still too stale
after finishing, or filtered, e.g. all-equal rewards) free their slot so the
trainer can never starve. A hard filter at consumption drops and counts any
group that exceeds k. k = 0 admits exactly one step's groups at a time: the
synchronous schedule. `take(version)` hands out a later step's groups by the
rule of that step's version, so the trainer can take them while it still
trains the step before.

Its counters are part of a checkpoint (`state` / `restore`), so a resumed run
admits exactly what the uninterrupted one would have; a producer failure
(`fail`) closes the bus and the trainer's next `take` raises it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

from relax_gym.trajectory import Trajectory

Group = list[Trajectory]


def group_staleness(group: Group, version: int) -> int:
    """Staleness of a group consumed at `version`; a group with no generated token is fresh."""
    oldest = [v for t in group if (v := t.min_version()) is not None]
    return version - min(oldest) if oldest else 0


class DataBus:
    def __init__(self, groups_per_step: int, max_staleness: int,
                 keep: Callable[[Group], bool] | None = None,
                 on_discard: Callable[[Group], None] | None = None):
        if groups_per_step < 1 or max_staleness < 0:
            raise ValueError("groups_per_step must be >= 1 and max_staleness >= 0")
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.keep = keep or (lambda group: True)
        #: told of every group consumed without being trained (too stale, or not kept)
        self.on_discard = on_discard or (lambda group: None)
        self.version = 0
        self.started = 0
        self.discarded = 0
        self.dropped_stale = 0
        self.filtered = 0
        self.staleness_histogram: Counter[int] = Counter()
        self._ready: list[Group] = []
        self._changed = asyncio.Condition()
        self.closed = False
        self.error: BaseException | None = None

    # --- checkpointing ----------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Run totals and admission counters, for a checkpoint."""
        return {"started": self.started, "discarded": self.discarded, "dropped_stale": self.dropped_stale,
                "filtered": self.filtered, "staleness_histogram": dict(self.staleness_histogram)}

    def restore(self, state: dict[str, Any], version: int, unfinished: int) -> None:
        """Continues from `state` at `version`; `unfinished` groups were started but lost with the old process
        and will be admitted again, so they give their slots back."""
        self.version = version
        self.started = int(state["started"]) - unfinished
        self.discarded = int(state["discarded"])
        self.dropped_stale = int(state["dropped_stale"])
        self.filtered = int(state["filtered"])
        self.staleness_histogram = Counter({int(k): int(v) for k, v in state["staleness_histogram"].items()})

    # --- producer side ----------------------------------------------------------------
    def _may_start(self) -> bool:
        return self.started - self.discarded < (self.version + self.max_staleness + 1) * self.groups_per_step

    async def admit(self) -> bool:
        """Waits until a new group may start; False once the bus is closed."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.closed or self._may_start())
            if self.closed:
                return False
            self.started += 1
            return True

    async def put(self, group: Group) -> None:
        async with self._changed:
            self._ready.append(group)
            self._changed.notify_all()

    # --- consumer side ----------------------------------------------------------------
    async def take(self, version: int | None = None) -> list[Group]:
        """The next `groups_per_step` groups that pass the staleness filter and `keep`, oldest first.

        `version` (default: the bus's) is the one they will be trained at: the trainer takes its next
        step's groups at that version while it still trains the current one, before it `advance`s."""
        at = self.version if version is None else version
        batch: list[Group] = []
        while len(batch) < self.groups_per_step:
            async with self._changed:
                await self._changed.wait_for(lambda: self.closed or self._ready)
                if not self._ready:
                    if self.error is not None:
                        raise self.error
                    raise EOFError("the data bus closed before a full step's groups arrived")
                group = self._ready.pop(0)
                staleness = group_staleness(group, at)
                if staleness > self.max_staleness:
                    self.dropped_stale += 1
                    self._discard(group)
                    continue
                if not self.keep(group):
                    self.filtered += 1
                    self._discard(group)
                    continue
            self.staleness_histogram[staleness] += 1
            batch.append(group)
        return batch

    def _discard(self, group: Group) -> None:
        self.discarded += 1
        self.on_discard(group)
        self._changed.notify_all()

    async def advance(self, version: int) -> None:
        """The trainer finished a step: new groups may start under the new version."""
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    async def close(self) -> None:
        async with self._changed:
            self.closed = True
            self._changed.notify_all()

    async def fail(self, error: BaseException) -> None:
        """The producer cannot go on: the bus closes, and `take` raises `error` once the ready groups run out."""
        async with self._changed:
            self.error = self.error or error
            self.closed = True
            self._changed.notify_all()
