"""OpenAI's routes written once: `/v1/chat/completions`, `/v1/responses` and `/v1/models`, as `relax-gym serve` answers
them and as the agent proxy answers them under each session's prefix (`/s/{sid}`).

The two differ only in how a chat is completed (the server under its queue's share, on an adapter a chat's `model`
names; the proxy on the episode's chain, recording the call) and in which models they list: both are the caller's
`complete` and `models`. The streaming and the Responses translation (`responses_api`) are the same for both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from relax_gym.engines.openai_api import ChatCompletionIn, stream_events
from relax_gym.engines.responses_api import ResponsesIn, respond, to_chat

#: a chat's completion in OpenAI's shape, or the answer that says why there is none (a 4xx, a 5xx)
Complete = Callable[[ChatCompletionIn, Request], Awaitable[dict[str, Any] | Response]]


def openai_router(complete: Complete, models: Callable[[], list[dict[str, Any]]], *, prefix: str = "") -> APIRouter:
    """The routes under `prefix` (which may hold path parameters, read from the request by `complete`). `models`
    gives each model listed: its `id` and any further fields (an adapter's `parent` and `root`)."""
    router = APIRouter(prefix=prefix)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionIn, request: Request) -> Any:
        """OpenAI's chat completions (`relax_gym.engines.openai_api`), as server-sent events when `body` streams."""
        answer = await complete(body, request)
        if body.stream and not isinstance(answer, Response):
            return StreamingResponse(stream_events(answer), media_type="text/event-stream")
        return answer

    @router.post("/v1/responses")
    async def responses(body: ResponsesIn, request: Request) -> Any:
        """OpenAI's Responses API, as a chat completion (`relax_gym.engines.responses_api`)."""
        return respond(await complete(to_chat(body), request), body)

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model["id"], "object": "model", "created": 0,
                                            "owned_by": "relax-gym", **model} for model in models()]}

    return router
