"""The process-wide settings a relax_gym process runs with, in one call each, so the CLI, every Ray role and a
script that builds an `EmbeddedEngine` or a `TorchBackend` get the same (docs/architecture.md, "CPU speed")."""

from __future__ import annotations

import functools
import gc

from relax_gym.cpu.native_heap import keep_large_blocks, share_one_heap


@functools.cache
def prepare_process() -> None:
    """One glibc heap for all of the process's threads (the engine's and the trainer's reuse what the other frees),
    and a step's large temporaries kept for reuse rather than faulted back in (`native_heap`). Call it first thing,
    before threads start: the CLI's `main`, each Ray role, `EmbeddedEngine` and `TorchBackend` do. Idempotent; a
    setting the user made through glibc's environment variables is left alone."""
    share_one_heap()
    keep_large_blocks()


def settle_heap() -> None:
    """Takes everything alive now (imported modules, models, tokenizers) out of the cyclic GC's reach.

    A rollout process allocates many short-lived objects, and each full collection would otherwise rescan the
    hundreds of thousands of long-lived ones torch and transformers create (measured: 256 concurrent episodes'
    overhead 8 % -> 2 %; see benchmarks/rollout_overhead.py). Process-wide, so it runs once a process has loaded
    its models: a run's loop, `relax-gym rollout`, each Ray role; a script may call it after loading its own.
    """
    gc.collect()
    gc.freeze()
