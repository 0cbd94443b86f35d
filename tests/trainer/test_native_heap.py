"""`release_free_memory`: glibc's `malloc_trim` after a training step gives freed activations back to the OS."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

from relax_gym.cpu.native_heap import free_heap_bytes, keep_large_blocks, release_free_memory, share_one_heap


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
    # not past the bound: left alone (the bound has a margin: other threads of a long suite free memory meanwhile,
    # which once took free heap past a bound of exactly `free`)
    assert not release_free_memory(above=free + 64 * 2**20)
    before = _rss_mb()
    assert release_free_memory(above=200 * 2**20)
    assert _rss_mb() < before - 200, (before, _rss_mb())
    del keep


_ARENAS = """
import ctypes, sys, threading
from relax_gym.cpu.native_heap import share_one_heap
took = share_one_heap() if sys.argv[1] == "one" else False
def allocate():
    blocks = [bytearray(64 * 1024) for _ in range(64)]  # under the mmap threshold: from the thread's heap
    ctypes.CDLL(None).malloc_stats()  # glibc writes each heap ("Arena N:") to stderr
thread = threading.Thread(target=allocate)
thread.start()
thread.join()
print(took)
"""


def test_one_heap_for_every_thread():
    """glibc's own `malloc_stats` shows a second heap for a thread that allocates, and none once
    `share_one_heap` ran (a user's MALLOC_ARENA_MAX is left alone)."""
    if platform.libc_ver()[0] != "glibc":
        assert not share_one_heap()  # no such heaps to share
        return
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    runs = {how: subprocess.run([sys.executable, "-c", _ARENAS, how], capture_output=True, text=True, env=env,
                                check=True) for how in ("default", "one")}
    assert runs["default"].stderr.count("Arena ") == 2 and runs["default"].stdout.split() == ["False"]
    assert runs["one"].stderr.count("Arena ") == 1 and runs["one"].stdout.split() == ["True"]
    mine = subprocess.run([sys.executable, "-c", _ARENAS, "one"], capture_output=True, text=True, check=True,
                          env={**env, "MALLOC_ARENA_MAX": "4"})
    assert mine.stdout.split() == ["False"] and mine.stderr.count("Arena ") == 2


_REUSE = """
import resource, sys
from relax_gym.cpu.native_heap import keep_large_blocks
took = keep_large_blocks() if sys.argv[1] == "keep" else False
if sys.argv[1] == "engine":  # a script's own engine: it applies the CLI's process settings itself
    from relax_gym.engines.embedded import EmbeddedEngine
    from relax_gym.models.loading import LoadedModel
    from relax_gym.models.tiny import build_tiny_text
    model, tokenizer = build_tiny_text()
    EmbeddedEngine(LoadedModel(model, tokenizer, None, ("text",), "tiny"))
def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step() -> None:  # a decode step's temporaries: logits, probabilities, their running sums
    blocks = [bytearray(12 * 2**20) for _ in range(3)]  # bytearray writes its zeros: each page is touched
    del blocks
step()
start = faults()
for _ in range(10):
    step()
print(took, (faults() - start) // 10)
"""


def test_large_blocks_freed_in_a_step_are_reused_by_the_next_without_faulting():
    """glibc's defaults hand a step's large freed blocks back to the OS, so each step faults their pages in
    anew; after `keep_large_blocks` the next step reuses them (a user's MALLOC_MMAP_THRESHOLD_ is left alone)."""
    if platform.libc_ver()[0] != "glibc":
        assert not keep_large_blocks()
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_"))}

    def run(how: str, **extra: str) -> list[str]:
        return subprocess.run([sys.executable, "-c", _REUSE, how], capture_output=True, text=True, check=True,
                              env={**env, **extra}).stdout.split()

    took, default_faults = run("default")
    assert took == "False" and int(default_faults) > 3 * 12 * 2**20 // 4096 // 2  # most pages fault again
    took, kept_faults = run("keep")
    assert took == "True" and int(kept_faults) < 100
    _, engine_faults = run("engine")  # `EmbeddedEngine` calls `prepare_process`, as the CLI's main does
    assert int(engine_faults) < 100
    assert run("keep", MALLOC_MMAP_THRESHOLD_="1048576")[0] == "False"
