"""Giving freed native memory back to the OS between training steps (glibc's `malloc_trim`), one heap for all of
a run's threads (`mallopt(M_ARENA_MAX, 1)`), and large blocks kept for reuse within a step (`keep_large_blocks`).

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
#: `mallopt`'s parameters, from glibc's malloc.h: the most heaps (arenas), the free bytes at a heap's top it keeps
#: before giving them back, and the size from which an allocation gets a mapping of its own
M_ARENA_MAX, M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -8, -1, -3
#: `keep_large_blocks`: allocations up to this come from the heap
MAP_ABOVE_BYTES = 32 * 2**20


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


def keep_large_blocks() -> bool:
    """Large blocks freed stay in the heap for the next allocation of their size, instead of going back to the OS
    and faulting back in, page by page, when next allocated; whether it took.

    A decode step allocates and frees the same large blocks each step (a 64-row batch's logits over a 49k
    vocabulary, the sampler's probabilities and their running sums: 12.6 MB each). glibc maps a block that large
    on its own and unmaps it when freed, or, once its dynamic threshold has risen past the block's size, trims the
    heap's top when two of them are freed: either way the pages come back zeroed, one fault each. 64 SmolLM2
    stories of 256 tokens took 1.1-1.2 million page faults, 4,500 a step; with blocks up to `MAP_ABOVE_BYTES`
    (glibc's own ceiling for its dynamic threshold) kept in the heap and its top trimmed only past twice that,
    0.26-0.28 million, and the engine ran 1.07x faster (733 against 685 tokens/s, three alternating pairs), while
    SmolLM2's arithmetic run peaked at 4.49 GB against 4.47 (256 MB kept: 4.57). Between training steps
    `release_free_memory` still trims what the heap holds free. A `MALLOC_MMAP_THRESHOLD_` or
    `MALLOC_TRIM_THRESHOLD_` the user set is left to rule."""
    libc = _glibc()
    if libc is None or {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MAP_ABOVE_BYTES) and libc.mallopt(M_TRIM_THRESHOLD, 2 * MAP_ABOVE_BYTES))
