"""`relax-gym serve`'s SGLang-native generation routes: `/generate`, and `/pause_generation`,
`/continue_generation` and `/flush_cache` around it. What differs from SGLang, by necessity:

- `/generate` takes one request per call (they are batched server-side); its `input_ids` must already hold the
  expanded image / audio placeholders, as `relax_gym.models.render_ids` gives them. Only output logprobs are
  returned (`logprob_start_len` is accepted, input logprobs are not computed). `image_data` / `audio_data` /
  `video_data` items are data URLs or bare base64, never server paths; a video's frames are all used, at its own
  rate (the SGLang client sends the clip's sampled frames losslessly), where SGLang samples frames again by its own
  rate and count.
- `/pause_generation` takes SGLang's modes but "retract": "abort" (the default) answers running requests with
  finish_reason "abort" and their tokens so far (message "Aborted"), queued ones with none ("Abort in waiting
  queue"); "in_place" lets the running batch finish, where SGLang would hold it. Requests arriving while paused
  wait for `/continue_generation`. As in SGLang, `/flush_cache` is refused (400) while requests run.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from PIL import Image

from relax_gym.engines.base import GenerateOutput, GenerateRequest, SamplingParams, check_fits
from relax_gym.engines.embedded import EmbeddedEngine
from relax_gym.engines.queue_share import QueueShare
from relax_gym.engines.server_admission import queue_full, unless_gone
from relax_gym.engines.server_limits import ServerLimits
from relax_gym.engines.server_media import MediaBudget, MediaError, decode_audio, decode_image, decode_video, not_taken
from relax_gym.engines.server_schemas import BadRequest, GenerateIn, PauseIn, listed
from relax_gym.engines.sglang import PAUSE_ABORTED, PAUSE_ABORTED_QUEUED
from relax_gym.video import Video

#: media decoded at once: each decode holds a full-size image, so this bounds their memory together
MEDIA_DECODERS = 2


def _decode_media(body: GenerateIn, limits: ServerLimits, model: str, modalities: tuple[str, ...]
                  ) -> tuple[list[Image.Image], list[tuple[np.ndarray, int]], list[Video]]:
    """The request's media, decoded under the limits; media the model cannot take are refused before any decoding
    (a decompression bomb sent to a text model costs nothing)."""
    images, audios, videos = listed(body.image_data), listed(body.audio_data), listed(body.video_data)
    if len(images) + len(audios) + len(videos) > limits.max_media_items:
        raise BadRequest(f"image_data, audio_data, video_data: {len(images) + len(audios) + len(videos)} items, over "
                         f"the server's limit of {limits.max_media_items} (max_media_items)")
    for field, items, kind, named in (("image_data", images, "image", "images"),
                                      ("audio_data", audios, "audio", "audio"),
                                      ("video_data", videos, "video", "video")):
        if items and kind not in modalities:
            raise BadRequest(f"{field}: {not_taken(model, modalities, named)}")
    budget = MediaBudget(limits.max_media_bytes)
    try:
        return (
            [decode_image(x, f"image_data[{i}]", max_pixels=limits.max_image_pixels, budget=budget)
             for i, x in enumerate(images)],
            [decode_audio(x, f"audio_data[{i}]", max_seconds=limits.max_audio_s, budget=budget)
             for i, x in enumerate(audios)],
            [decode_video(x, f"video_data[{i}]", max_frames=limits.max_video_frames,
                          max_pixels=limits.max_image_pixels, budget=budget) for i, x in enumerate(videos)],
        )
    except MediaError as err:
        raise BadRequest(str(err)) from None


def _check_placeholders(body: GenerateIn, processor: Any) -> None:
    """Expanded `input_ids` hold a medium's placeholder id when, and only when, the request sends that medium
    (checked after the media decoded: their own errors come first). How many runs an item expands to is the
    family's (a Qwen-VL video is one run per frame group), so a count that is off is the model's own check to
    find (a 400 too)."""
    if processor is None or body.input_ids is None:
        return
    for field, kind in (("image_data", "image"), ("audio_data", "audio"), ("video_data", "video")):
        token_id = getattr(processor, f"{kind}_token_id", None)
        if not isinstance(token_id, int):
            continue
        items = len(listed(getattr(body, field)))
        held = token_id in body.input_ids
        if bool(items) != held:
            raise BadRequest(f"{field}: {items} item(s), and input_ids hold {'some' if held else 'no'} {kind} "
                             f"placeholder ids ({token_id}): send the ids `relax_gym.models.render_ids` expands")


def _check_chars(text: str, context: int | None, per_token: int) -> None:
    if context is not None and len(text) > context * per_token:
        raise BadRequest(f"text: {len(text)} characters cannot fit in the model's context of {context} tokens "
                         f"(its longest token is {per_token} characters)")


def _check_length(prompt: int, max_new_tokens: int, context: int | None, field: str) -> None:
    if context is not None:
        check_fits(prompt, max_new_tokens, context, field)


def _finish_reason(
    engine: EmbeddedEngine, out: GenerateOutput, params: SamplingParams, timeout_s: float, elapsed_s: float
) -> dict[str, Any]:
    """SGLang's finish_reason object: what matched for "stop", the length for "length", for "abort" SGLang's
    messages when a pause (or the server closing) ended the request, else this server's timeout."""
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.output_ids)}
    if out.finish_reason == "abort":
        if elapsed_s < timeout_s:
            message = PAUSE_ABORTED if out.output_ids else PAUSE_ABORTED_QUEUED
        else:
            message = f"aborted: the request ran past the server's request_timeout_s ({timeout_s:g} s)"
        return {"type": "abort", "message": message, "status_code": None, "err_type": None}
    last = out.output_ids[-1]
    if last in engine.eos_token_ids or last in params.stop_token_ids:
        return {"type": "stop", "matched": last}
    text = engine.loaded.tokenizer.decode(out.output_ids, skip_special_tokens=False)
    return {"type": "stop", "matched": next((s for s in params.stop if s in text), None)}


def _answer(
    engine: EmbeddedEngine, body: GenerateIn, out: GenerateOutput, started: float, timeout_s: float
) -> dict[str, Any]:
    params = body.sampling_params.to_params()
    finish = _finish_reason(engine, out, params, timeout_s, time.perf_counter() - started)
    text = engine.loaded.decode(out.output_ids, skip_special_tokens=body.sampling_params.skip_special_tokens)
    if isinstance(finish.get("matched"), str) and not body.sampling_params.no_stop_trim:
        text = text[: text.find(finish["matched"])] if finish["matched"] in text else text
    meta: dict[str, Any] = {
        "id": body.rid or uuid.uuid4().hex,
        "finish_reason": finish,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": 0,
        "weight_version": str(out.weight_version),
        "e2e_latency": time.perf_counter() - started,
    }
    if body.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.logprobs, out.output_ids, strict=True)]
    if out.routed_experts is not None:  # SGLang's encoding: base64 of the int32 [token, layer, top_k] array
        meta["routed_experts"] = base64.b64encode(out.routed_experts.astype(np.int32).tobytes()).decode()
    return {"text": text, "output_ids": out.output_ids, "meta_info": meta}



def generate_routes(engine: EmbeddedEngine, limits: ServerLimits, queue: QueueShare, context: int | None) -> APIRouter:
    """The generation routes over `engine`; `/generate` holds one sample of `queue` and checks prompts against
    `context` (None: unbounded)."""
    router = APIRouter()
    per_token = engine.loaded.max_token_chars
    decoders = asyncio.Semaphore(MEDIA_DECODERS)

    async def to_request(body: GenerateIn) -> GenerateRequest:
        params = body.sampling_params.to_params()
        if body.input_ids is not None:
            _check_length(len(body.input_ids), params.max_new_tokens, context, "input_ids")
        else:  # before the media are decoded and the text tokenized
            _check_chars(body.text or "", context, per_token)
        async with decoders:
            images, audios, videos = await asyncio.to_thread(_decode_media, body, limits, engine.loaded.name,
                                                             engine.loaded.modalities)
        routes = body.return_routed_experts
        if body.input_ids is not None:
            _check_placeholders(body, engine.loaded.processor)
            return GenerateRequest(body.input_ids, params, images, audios, rid=body.rid, return_routed_experts=routes,
                                   videos=videos, adapter=body.lora_path)
        assert body.text is not None  # GenerateIn's validator: exactly one of text and input_ids
        ids, media = await asyncio.to_thread(engine.encode, body.text, images, audios, videos)
        _check_length(len(ids), params.max_new_tokens, context, "text")
        return GenerateRequest(ids, params, images, audios, media or None, body.rid, return_routed_experts=routes,
                               videos=videos, adapter=body.lora_path)

    @router.post("/generate")
    async def generate(body: GenerateIn, request: Request) -> Any:
        hold = queue.take(1)
        if hold is None:
            return queue_full(queue)
        try:
            started = time.perf_counter()
            out = await unless_gone(
                request, engine.generate(await to_request(body), timeout_s=limits.request_timeout_s), hold.displaced
            )
            if out is None:
                return Response(status_code=499)  # nobody reads it: the client has gone
            return _answer(engine, body, out, started, limits.request_timeout_s)
        finally:
            queue.give_back(hold)

    @router.post("/pause_generation")
    async def pause(body: PauseIn | None = None) -> dict[str, Any]:
        mode = "abort" if body is None else body.mode
        if mode == "retract":
            raise BadRequest("mode: 'retract' is not supported here; 'abort' (the default) or 'in_place'")
        await engine.pause(abort=mode == "abort")
        return {"message": "Generation paused successfully.", "status": "ok"}

    @router.post("/continue_generation")
    async def resume() -> dict[str, Any]:
        await engine.resume()
        return {"success": True, "message": "Generation continued."}

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        """SGLang's answer: 200, or 400 while requests are running (queued ones of a paused server do not count)."""
        if engine.busy:
            return PlainTextResponse("Cache not flushed: requests are running.", status_code=400)
        return PlainTextResponse("Cache flushed.")

    return router
