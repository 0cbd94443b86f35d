"""`release_free_memory`: glibc's `malloc_trim` after a training step gives freed activations back to the OS."""

from __future__ import annotations

import platform

from relax_gym.native_heap import free_heap_bytes, release_free_memory


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_freed_blocks_go_back_to_the_os_only_when_many_are_free():
    """Many small blocks (under glibc's mmap threshold) stay in the heap once freed, until a trim."""
    if platform.libc_ver()[0] != "glibc":
        assert free_heap_bytes() is None and not release_free_memory()
        return
    blocks = [bytearray(64 * 1024) for _ in range(6000)]  # ~375 MB in the heap, each block below mmap's threshold
    keep = blocks[::50]  # a few live blocks spread through it, as a step's surviving tensors are
    del blocks
    free = free_heap_bytes()
    assert free is not None and free > 300 * 2**20
    assert not release_free_memory(above=free)  # not past the bound: left alone
    before = _rss_mb()
    assert release_free_memory(above=200 * 2**20)
    assert _rss_mb() < before - 200, (before, _rss_mb())
    del keep
