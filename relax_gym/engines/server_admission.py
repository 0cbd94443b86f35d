"""A served request's place in the queue (`queue_share`): the 503s when the queue is full or the request was
displaced, and the wait that drops a request whose client went away, so no sample is generated for no one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from relax_gym.engines.queue_share import QueueShare
from relax_gym.web.errors import error_response

T = TypeVar("T")


async def unless_gone(request: Request, work: Awaitable[T], displaced: asyncio.Event) -> T | None:
    """`work`'s result, or None once the client has disconnected or a smaller request displaced this one (then
    `work` is cancelled)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watchers = {asyncio.ensure_future(gone()), asyncio.ensure_future(displaced.wait())}
    try:
        done, _ = await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watcher in watchers:
            watcher.cancel()
        if not task.done():
            task.cancel()  # only asks: the task is not cancelled yet, so its result must not be read
    return task.result() if task in done else None


def queue_full(queue: QueueShare) -> JSONResponse:
    return error_response(503, f"the server holds {queue.held} samples, its limit (max_pending), in requests no "
                               "larger than this one: retry later", {"Retry-After": "1"})


def displaced(queue: QueueShare, slots: int) -> JSONResponse:
    return error_response(503, f"displaced by a smaller request: the queue was full (max_pending {queue.capacity} "
                               f"samples) and its largest requests yield; this one held {slots}: retry later, or ask "
                               "for fewer samples (n)", {"Retry-After": "1"})

