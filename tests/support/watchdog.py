"""What a test that runs too long prints, and where: the terminal's stderr, which a test's captured output is not
(a hung test's capture dies with the suite)."""

from __future__ import annotations

import faulthandler
import json
import os
from pathlib import Path
from typing import Any

import pytest

#: the terminal's stderr, duplicated before any test runs (tests/conftest.py's pytest_configure)
TERMINAL_FD = pytest.StashKey[int]()


def say(fd: int, text: str) -> None:
    os.write(fd, text.encode(errors="replace"))


def dump_stacks(fd: int) -> None:
    faulthandler.dump_traceback(file=fd, all_threads=True)


def describe_tasks(limit: int = 20) -> str:
    """Where each pending asyncio task of this process waits (the innermost frame of its coroutine): what a
    stuck loop's thread stack does not show. Reads asyncio's own registry of tasks, from another thread."""
    import asyncio

    lines = []
    for task in [t for t in list(asyncio.tasks._all_tasks) if not t.done()][:limit]:
        frames = task.get_stack()
        where = f"{frames[-1].f_code.co_filename}:{frames[-1].f_lineno}" if frames else "not started"
        lines.append(f"  task {task.get_name()} {task.get_coro().__qualname__}: at {where}")
    return "\n".join(["pending asyncio tasks:", *lines])


def describe_run(run: Any) -> str:
    """A distributed run's roles and last events, read from another thread while its loop may be stuck (a
    snapshot: any field may be mid-change)."""
    lines = [f"run {run.run_dir}: step {run.step}, trainer rank {'up' if run._trainer_actor is not None else 'down'}"
             f" ({run.trainer_restarts} restarts)"]
    try:
        for view in run.fleet.engines():
            lines.append(f"  engine {view.engine_id} ({view.kind}): {view.state} at v{view.version}, "
                         f"{view.inflight} in flight, {view.served} served")
        for slot in run.workers.slots.values():
            state = "alive" if slot.alive else ("retired" if slot.retired else "being recreated")
            lines.append(f"  worker {slot.worker_id}: {state}, {slot.inflight} calls in flight")
        if run.bus is not None:
            lines.append(f"  bus: {run.bus.state()}")
    except Exception as err:  # a role not made yet, or changing under us
        lines.append(f"  (roles unreadable: {type(err).__name__}: {err})")
    path = Path(run.run_dir) / "events.jsonl"
    recent = path.read_text().splitlines()[-8:] if path.is_file() else []
    lines += ["  last events:"] + [f"    {json.loads(line)}"[:300] for line in recent]
    return "\n".join(lines)
