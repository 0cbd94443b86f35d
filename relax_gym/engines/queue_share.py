"""The served engine's queue, shared so that no one request shape takes all of it.

`max_pending` counts samples (a chat with `n=64` holds 64). Before this, four such requests filled a
256-sample queue and every other client got 503 until they finished. Now a request that finds the queue
full displaces the newest of the *largest* requests held, as long as each of those is larger than it:
the big ones yield to the small ones, so one client asking for many samples per request cannot lock out
the rollout fleet, whose `/generate` requests hold one sample each.

The share is per request, which over HTTP/1.1 is per connection (a connection carries one request at a
time). What it does not bound: many connections each holding a small request fill the queue too; the
connection cap (`max_connections`) bounds that, and a share per client needs a key per client.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class Hold:
    """One admitted request's slots; `displaced` is set when a smaller request took them."""

    slots: int
    order: int
    displaced: asyncio.Event = field(default_factory=asyncio.Event)


class QueueShare:
    """Admission to a queue of `capacity` slots, the largest requests yielding to smaller ones when it is full."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._holds: set[Hold] = set()
        self._order = itertools.count()

    @property
    def held(self) -> int:
        return sum(hold.slots for hold in self._holds)

    def take(self, slots: int) -> Hold | None:
        """A hold of `slots`, or None when the queue is full of requests no larger than this one."""
        room = self.capacity - self.held
        if slots > room:
            larger = sorted((h for h in self._holds if h.slots > slots), key=lambda h: (-h.slots, -h.order))
            victims = []
            for hold in larger:
                if slots <= room:
                    break
                victims.append(hold)
                room += hold.slots
            if slots > room:
                return None
            for hold in victims:
                self._holds.discard(hold)
                hold.displaced.set()
        hold = Hold(slots, next(self._order))
        self._holds.add(hold)
        return hold

    def give_back(self, hold: Hold) -> None:
        """Frees `hold`'s slots (a displaced hold's are free already)."""
        self._holds.discard(hold)
