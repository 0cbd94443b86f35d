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

Each thread that runs a parallel torch op keeps a pool of OpenMP workers (libgomp, which torch's Linux wheels
bundle). libgomp lets a worker spin-wait for the next parallel region only while it manages no more threads
than there are CPUs; past that, every team's workers sleep on a futex between regions. A decode step of a 135M
model is ~500 regions, and on this project's 2-core VMs the wake-ups made the step 107 ms where it takes 80 (64
rows) as soon as one idle pool beside the engine's (the main thread's, from loading the model) tipped the count;
`GOMP_SPINCOUNT` does not reach that case. So a thread that stops computing calls `release_openmp_workers`: the
engine's worker when it goes idle, the thread that built the engine, the trainer's thread after each call, a
run's main thread once it has loaded and resumed. Two roles computing at once on two cores still sleep between
regions, as they should.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ThreadPlacement", "check_cores", "release_openmp_workers"]

#: `omp_pause_resource_all`'s `omp_pause_soft` (OpenMP 5.0)
_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy), or None (no torch yet, another OpenMP, not
    Linux). Read from /proc/self/maps: torch's wheels bundle it under their own name and path."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/libgomp" in line]
    except OSError:
        return None
    if not paths:
        return None
    path = next((p for p in paths if "/torch/" in p), paths[0])  # another library may bring its own libgomp
    try:
        lib = ctypes.CDLL(path)  # already loaded: dlopen returns the same library
    except OSError:  # the file was replaced or removed since it loaded: leave the workers be
        return None
    return lib if hasattr(lib, "omp_pause_resource_all") else None


def release_openmp_workers() -> bool:
    """Ends the calling thread's idle OpenMP workers (module docstring); its next parallel op starts new ones
    (a thread start, ~0.1 ms). False where there is no libgomp to ask; never call it from inside a parallel op.
    """
    if "torch" not in sys.modules:  # nothing has started a pool (and libgomp may not be loaded yet)
        return False
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(_PAUSE_SOFT) == 0


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
