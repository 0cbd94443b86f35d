"""How many times a role may be recreated: `limit` restarts per sliding `window_s`, and the run total.

One rule for engines and rollout workers alike; `total` is what the run's metrics count (it never shrinks as the
window slides), `in_window` is what the budget spends.
"""

from __future__ import annotations

import time
from collections import deque


class RestartBudget:
    def __init__(self, limit: int, window_s: float):
        self.limit = limit
        self.window_s = window_s
        self.total = 0
        self._times: deque[float] = deque()

    @property
    def in_window(self) -> int:
        """Restarts in the last `window_s`."""
        now = time.monotonic()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        return len(self._times)

    def spend(self) -> bool:
        """Takes one restart if the window has room (True), else False: the role stays dead."""
        if self.in_window >= self.limit:
            return False
        self._times.append(time.monotonic())
        self.total += 1
        return True
