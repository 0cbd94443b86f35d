"""`relax-gym serve`'s SGLang-native status routes: liveness (`/health`, `/health_generate`), what model is served
(`/model_info`) and how the server runs (`/server_info`); the last two answer under SGLang's current names and its
older `get_` ones."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from relax_gym.engines.base import EngineError, GenerateRequest, SamplingParams
from relax_gym.engines.embedded import EmbeddedEngine
from relax_gym.engines.queue_share import QueueShare
from relax_gym.engines.server_limits import ServerLimits
from relax_gym.engines.sglang import SERVE_BACKEND
from relax_gym.version import __version__


def status_routes(engine: EmbeddedEngine, limits: ServerLimits, queue: QueueShare, context: int | None) -> APIRouter:
    """The status routes over `engine`; `/server_info` tells `queue`'s held samples, `/model_info` `context`."""
    router = APIRouter()
    name = engine.loaded.name

    @router.get("/health")
    async def health() -> PlainTextResponse:
        ok = await engine.health()
        return PlainTextResponse("" if ok else "engine is closed", status_code=200 if ok else 503)

    @router.get("/health_generate")
    async def health_generate() -> PlainTextResponse:
        """One token within `health_timeout_s`, else 503: a stuck engine is not healthy. Under continuous
        batching the probe joins a running batch, so a busy engine that makes progress is healthy, as SGLang's
        own route answers; under static batching it waits for the batch."""
        if engine.paused:
            return PlainTextResponse("generation is paused", status_code=503)
        probe = GenerateRequest([engine.pad_token_id], SamplingParams(temperature=0, max_new_tokens=1))
        try:
            await asyncio.wait_for(engine.generate(probe), timeout=limits.health_timeout_s)
        except TimeoutError:
            return PlainTextResponse(f"no token generated within {limits.health_timeout_s:g} s (health_timeout_s)",
                                     status_code=503)
        except EngineError as err:
            return PlainTextResponse(f"generation failed: {err}", status_code=503)
        return PlainTextResponse("")

    @router.get("/model_info")
    @router.get("/get_model_info")  # SGLang's older name, which it still answers
    async def model_info() -> dict[str, Any]:
        modalities = engine.loaded.modalities
        return {
            "model_path": name,
            "tokenizer_path": name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(engine.weight_version),
            "has_image_understanding": "image" in modalities,
            "has_audio_understanding": "audio" in modalities,
            "has_video_understanding": "video" in modalities,
            "modalities": list(modalities),
            "context_length": context,
        }

    @router.get("/server_info")
    @router.get("/get_server_info")  # SGLang's older name, which it still answers
    async def server_info() -> dict[str, Any]:
        return {
            "version": __version__,
            "backend": f"{SERVE_BACKEND} (transformers)",
            "model_path": name,
            "device": str(engine.device),
            "dtype": str(engine.model.dtype).removeprefix("torch."),
            "max_batch_size": engine.max_batch_size,
            "paused": engine.paused,
            "weight_version": str(engine.weight_version),
            "pending_requests": queue.held,
            "limits": limits.model_dump(),
        }

    return router
