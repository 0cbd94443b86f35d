"""Which cores a role's thread runs on, and how many torch threads it uses.

In one process the embedded engine and the trainer each run their torch code in a thread of their own.
Left alone, both spread over every core with torch's default thread count, and on a small machine
they take turns on the same cores, so an async run overlaps little. Pinned, each role keeps its
cores: with two cores, one each, an async step approaches max(rollout, train) instead of their sum.

Linux applies `sched_setaffinity(0, ...)` to the calling thread only, and threads it starts later
(torch's OpenMP workers) inherit it; `torch.set_num_threads` sets the calling thread's OpenMP
thread count, and torch starts threads created after that call with the same count. So
`ThreadPlacement.apply` runs first thing in the role's own thread, and a role whose `threads` is
unset gets whatever count torch holds when its thread starts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ThreadPlacement", "check_cores"]


def check_cores(cores: Sequence[int]) -> None:
    """Raises ValueError when a core is not one of this machine's (checked against the machine, not the calling
    thread's affinity, which may already be narrower: the process's main thread can be pinned)."""
    count = os.cpu_count() or 1
    missing = sorted(c for c in set(cores) if not 0 <= c < count)
    if missing:
        raise ValueError(f"cores {missing} do not exist on this machine (cores 0..{count - 1})")


@dataclass(frozen=True)
class ThreadPlacement:
    """Cores and torch thread count for one role's thread; None leaves that setting as the process has it."""

    cores: tuple[int, ...] | None = None
    threads: int | None = None

    def apply(self) -> None:
        """Pins the calling thread; call it from the thread that will run the role's torch code."""
        if self.cores:
            try:
                os.sched_setaffinity(0, self.cores)
            except OSError as err:  # a core outside this process's cpuset (a container's limit)
                raise ValueError(f"cannot run on cores {list(self.cores)}: {err}") from err
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
