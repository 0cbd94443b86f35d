"""Giving freed native memory back to the OS between training steps (glibc's `malloc_trim`), and one heap for
all of a run's threads (`mallopt(M_ARENA_MAX, 1)`).

torch allocates a CPU tensor with malloc. A training step frees gigabytes of activations and gradients of sizes
that change with each batch, and glibc keeps what it freed in its heaps, in pieces the next step's sizes often
do not fit: on SmolLM2-135M a run's RSS climbed by about 0.25 GB a step (3.4 -> 6.9 GB over six steps) with the
live tensors the same size. `malloc_trim(0)` hands every free page back. It costs a walk of the heap and the
pages faulted back in, so it runs only when the heaps hold more than `TRIM_ABOVE_BYTES` free. SmolLM2's steps
leave 1-2.5 GB free, a tiny model's 20-40 MB: trimming after each of those was 2 % of the quickstart's time.
No library does this for torch on a CPU.

glibc also gives each thread that allocates its own heap (an arena, up to 8 a core). A run's engine and trainer
are threads: what the engine frees (a batch's KV cache) the trainer cannot reuse for its activations, and each
heap keeps its own high-water mark. `share_one_heap` makes them allocate from one; the CLI calls it first thing.
SmolLM2's arithmetic run as configured peaked at 4.66-4.77 GB with a heap per thread and 4.48-4.53 GB with one,
its steps no slower (benchmarks/RESULTS.md, the memory section): torch allocates a tensor at a time, so the one
heap's lock is seldom contended.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

#: free bytes in glibc's heaps above which a step's end trims them
TRIM_ABOVE_BYTES = 256 * 2**20
#: `mallopt`'s parameter for the most heaps (arenas) glibc makes, from its malloc.h
M_ARENA_MAX = -8


class _Mallinfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33+): `fordblks` is the free bytes in its heaps."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _glibc() -> Any | None:
    """The C library where it has `malloc_trim` and `mallinfo2` (glibc 2.33+), else None (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    return libc


def free_heap_bytes() -> int | None:
    """Bytes free in glibc's heaps, their pages resident or already trimmed; None where that cannot be read."""
    libc = _glibc()
    return None if libc is None else int(libc.mallinfo2().fordblks)


def release_free_memory(above: int = TRIM_ABOVE_BYTES) -> bool:
    """Returns the C heaps' free pages to the OS when they hold more than `above` bytes; whether it trimmed."""
    libc = _glibc()
    if libc is None or libc.mallinfo2().fordblks <= above:
        return False
    libc.malloc_trim(0)
    return True


def share_one_heap() -> bool:
    """Every thread started from now on allocates from glibc's one main heap (module docstring); whether it took.

    Call it before the process starts threads: a thread keeps the heap it first allocated from. A
    `MALLOC_ARENA_MAX` the user set is left to rule; musl and macOS have no such heaps (False)."""
    libc = _glibc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, 1))
