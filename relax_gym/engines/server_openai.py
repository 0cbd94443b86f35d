"""`relax-gym serve`'s OpenAI-compatible routes (`openai_routes`): a chat completes on the served model under the
queue's share, like `/generate`, and a chat's `model` naming a loaded LoRA adapter runs on it (vLLM's way), so
`/v1/models` lists the adapters beside the base."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from relax_gym.engines.embedded import EmbeddedEngine
from relax_gym.engines.openai_api import ChatCompletionIn, chat_completion
from relax_gym.engines.openai_routes import openai_router
from relax_gym.engines.queue_share import QueueShare
from relax_gym.engines.server_admission import displaced, queue_full, unless_gone
from relax_gym.engines.server_limits import ServerLimits
from relax_gym.engines.server_media import image_reader
from relax_gym.tools.formats import tool_format_of


def openai_routes(engine: EmbeddedEngine, limits: ServerLimits, queue: QueueShare, context: int | None) -> APIRouter:
    """The OpenAI routes over `engine`: a chat of `n` samples holds `n` of `queue`, and must fit `context`."""
    name = engine.loaded.name
    tool_format = tool_format_of(engine.loaded)

    async def completed(body: ChatCompletionIn, request: Request) -> dict[str, Any] | Response:
        """The chat completion of `body` under the queue's share, or the answer that says why there is none."""
        hold = queue.take(body.n)
        if hold is None:
            return queue_full(queue)
        # vLLM's way: a `model` naming a loaded adapter runs on it (the base's name, or none, on the base)
        adapter = body.model if body.model in engine.adapters.folders else None
        try:
            answer = await unless_gone(request, chat_completion(
                engine, engine.loaded, body, tool_format=tool_format,
                decode_image=image_reader(name, engine.loaded.modalities, limits), model_name=adapter or name,
                context=context, timeout_s=limits.request_timeout_s, adapter=adapter), hold.displaced)
        finally:
            queue.give_back(hold)
        if hold.displaced.is_set():
            return displaced(queue, body.n)
        return Response(status_code=499) if answer is None else answer

    def models() -> list[dict[str, Any]]:
        """The base, and each loaded adapter with the base as its parent and its folder as its root."""
        return [{"id": name}] + [{"id": adapter, "parent": name, "root": folder}
                                 for adapter, folder in engine.adapters.folders.items()]

    return openai_router(completed, models)
