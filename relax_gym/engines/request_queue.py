"""The embedded engine's inbox: the requests and weight updates callers queue for its worker thread, and the
pause / abort / close flags they steer it with, all under one condition.

Callers wait on their own event loops and the worker runs on its own thread, so every item carries its caller's
loop and is answered there (`resolve`), never from the worker directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from relax_gym.engines.base import EngineError, GenerateOutput, GenerateRequest


def resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any) -> None:
    """Completes `future` on its own loop from the worker thread; a closed loop has no one waiting."""

    def complete() -> None:
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(complete)


@dataclass(eq=False)  # compared by identity: the deque of queued jobs is searched for one
class Job:
    request: GenerateRequest
    mm_inputs: dict[str, torch.Tensor]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    #: set past the caller's deadline: the row ends with "abort" at its next step, keeping what it generated
    aborted: bool = False
    #: `RequestQueue.pause(abort=True)` calls before this job arrived: a later one aborts it
    aborts_seen: int = 0
    #: the engine's count of running requests, once the worker has taken this one (it leaves it when answered)
    running: Running | None = None

    def resolve(self, value: GenerateOutput | BaseException) -> None:
        if self.running is not None:  # before the answer is sent: whoever reads it finds the engine without it
            self.running.leave()
            self.running = None
        resolve(self.loop, self.future, value)


class Running:
    """Requests taken by the worker and not yet answered (SGLang's running requests)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def join(self, job: Job) -> None:
        with self._lock:
            self.count += 1
        job.running = self

    def leave(self) -> None:
        with self._lock:
            self.count -= 1


@dataclass
class Update:
    """Checked tensors to copy into the model, and the version they make it."""

    tensors: dict[str, torch.Tensor]
    version: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass
class AdapterChange:
    """A LoRA adapter loaded or unloaded (`ResidentAdapters`), applied as a weight update is: between batches."""

    change: Callable[[], None]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def end_unstarted(jobs: list[Job], version: int) -> None:
    """Answers jobs taken off the queue before they ran: finish_reason "abort", no tokens."""
    for job in jobs:
        job.resolve(GenerateOutput([], [], "abort", version, len(job.request.input_ids)))


class RequestQueue:
    """Jobs and updates waiting for the worker, and the flags it reads; `cond` guards them all."""

    def __init__(self, name: str, *, max_batch_size: int, batch_window_s: float) -> None:
        self.name = name
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.jobs: deque[Job] = deque()
        self.updates: deque[Update | AdapterChange] = deque()
        self.cond = threading.Condition()
        self.paused = False
        self.aborts = 0  # `pause(abort=True)` calls so far
        self.closed = False
        self.busy = False  # a batch is running (what `pause` waits for)
        self.running = Running()

    def check_open(self) -> None:
        if self.closed:
            raise EngineError(f"the embedded engine for {self.name!r} is closed")

    def put(self, job: Job) -> None:
        with self.cond:
            self.check_open()
            job.aborts_seen = self.aborts
            self.jobs.append(job)
            self.cond.notify_all()

    async def put_update(self, update: Update | AdapterChange) -> None:
        """Queues `update` for the worker to apply between batches, and waits until it has."""
        with self.cond:
            self.check_open()
            self.updates.append(update)
            self.cond.notify_all()
        await update.future

    def pause(self, *, abort: bool) -> list[Job]:
        """Holds queued jobs back from the worker; with `abort`, takes them off the queue, for the caller to end,
        and makes running jobs end at their next step."""
        with self.cond:
            self.paused = True
            queued: list[Job] = []
            if abort:
                self.aborts += 1
                queued = list(self.jobs)
                self.jobs.clear()
        return queued

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def abort(self, job: Job) -> bool:
        """Marks `job` to end at its batch's next step; if it is still queued, takes it off instead and returns
        True, for the caller to end."""
        with self.cond:
            job.aborted = True
            queued = job in self.jobs
            if queued:
                self.jobs.remove(job)
        return queued

    def ends(self, job: Job) -> bool:
        """Whether a running job stops at this step with finish_reason "abort", keeping what it generated."""
        return self.closed or job.aborted or job.aborts_seen < self.aborts or job.future.cancelled()

    def has_work(self) -> bool:
        return self.closed or bool(self.updates) or (not self.paused and bool(self.jobs))

    def wait_idle(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.busy or self.closed)

    def coalesce(self) -> None:
        """Waits up to `batch_window_s` for a burst of concurrent requests to finish arriving."""
        deadline = time.monotonic() + self.batch_window_s
        with self.cond:
            while len(self.jobs) < self.max_batch_size and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0 or not self.cond.wait(left):
                    return

    def take(self, limit: int | None = None) -> list[Job]:
        """Up to `limit` (default `max_batch_size`) queued jobs, counted as running; the caller holds `cond`."""
        jobs: list[Job] = []
        limit = self.max_batch_size if limit is None else limit
        while self.jobs and len(jobs) < limit and not self.paused:
            job = self.jobs.popleft()
            if not job.future.cancelled():
                self.running.join(job)
                jobs.append(job)
        return jobs

    def drain(self, version: int) -> None:
        """After close: nothing queued may hang."""
        with self.cond:
            jobs, updates = list(self.jobs), list(self.updates)
            self.jobs.clear()
            self.updates.clear()
        end_unstarted(jobs, version)
        for update in updates:
            resolve(update.loop, update.future, EngineError("the embedded engine closed before the update"))
