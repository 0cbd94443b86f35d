"""The embedded engine behind SGLang's native HTTP routes (`relax-gym serve`).

The same `SGLangEngine` client then drives a real SGLang server or this one, so
the client is tested over real HTTP on any machine, and CPU rollout workers can
share one served model. What differs from SGLang, by necessity:

- `/generate` takes one request per call (they are batched server-side); its
  `input_ids` must already hold the expanded image / audio placeholders, as
  `relax_gym.models.render_ids` gives them. Only output logprobs are returned
  (`logprob_start_len` is accepted, input logprobs are not computed).
  `image_data` / `audio_data` / `video_data` items are data URLs or bare base64, never server paths;
  a video's frames are all used, at its own rate (the SGLang client sends the clip's sampled frames
  losslessly), where SGLang samples frames again by its own rate and count.
- `/update_weights_from_tensor` takes SGLang's `serialized_named_tensors`
  (tensors shared from a process on this host: CUDA IPC handles, or shared
  memory for CPU tensors; unpickled against an allowlist, see `tensor_ipc`), or
  `{"safetensors_b64": <base64 of a safetensors file>}` from anywhere.
  Refused: `load_format` (flattened buckets) and `abort_all_requests=true`.
- `/init_weights_update_group`, `/update_weights_from_distributed` and
  `/destroy_weights_update_group` take SGLang's bodies: the server joins the
  trainer's named group (`weight_group`: gloo on CPU, NCCL on GPU) as one rank,
  `rank_offset`; received tensors load through the same checked path as the other
  updates, between batches (generation goes on while they arrive). Refused:
  `load_format` (flattened buckets) and `abort_all_requests=true`.
- As in SGLang 0.5.21+, `/update_weights_from_tensor` and `/update_weights_from_distributed` run only inside
  a weight-update session (`/begin_weight_update` ... `/end_weight_update`, which neither pause nor flush);
  outside one they are refused (400) with SGLang's message. `/model_info` and `/server_info` answer under
  SGLang's current names and its older `get_` ones.
- `/pause_generation` takes SGLang's modes but "retract": "abort" (the default)
  answers running requests with finish_reason "abort" and their tokens so far
  (message "Aborted"), queued ones with none ("Abort in waiting queue"); "in_place"
  lets the running batch finish, where SGLang would hold it. Requests arriving
  while paused wait for `/continue_generation`. As in SGLang, `/flush_cache` is
  refused (400) while requests run, and so is a weight update with
  `flush_cache: true` (its default), where SGLang before 0.5.22 fails an
  assertion in its scheduler.
- `weight_version` is a string of the engine's integer version, as SGLang's is a
  string; here it only goes up (an update with an older version is refused).

What it guards against (limits and defaults: `server_limits.ServerLimits`; transport: `relax_gym.web.guard`):
every route but health and model info needs the API key as a bearer token; a
request is refused with a 4xx naming its field before it costs the server
more than its body (a prompt or `max_new_tokens` past the context, media past
their pixel / duration caps, non-finite or out-of-range numbers, text that is
not UTF-8); a request that runs past `request_timeout_s` ends with finish_reason
"abort", one whose client goes away is dropped; past `max_pending` samples
the answer is 503 with Retry-After, and a full queue's largest requests yield to smaller ones
(`queue_share`); weight updates are checked whole (names,
shapes, dtypes, finite values) before they touch the model.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from PIL import Image
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator
from safetensors.torch import load as load_safetensors

from relax_gym.engines import tensor_ipc
from relax_gym.engines.base import (
    EngineError,
    GenerateOutput,
    GenerateRequest,
    RequestError,
    SamplingParams,
    check_fits,
)
from relax_gym.engines.embedded import EmbeddedEngine, engine_device
from relax_gym.engines.openai_api import ChatCompletionIn, chat_completion, stream_events
from relax_gym.engines.queue_share import QueueShare
from relax_gym.engines.responses_api import ResponsesIn, respond, to_chat
from relax_gym.engines.server_limits import ServerLimits
from relax_gym.engines.server_media import (
    MediaBudget,
    MediaError,
    decode_audio,
    decode_image,
    decode_video,
    image_reader,
    not_taken,
)
from relax_gym.engines.sglang import PAUSE_ABORTED, PAUSE_ABORTED_QUEUED, SERVE_BACKEND
from relax_gym.engines.weight_group import WeightGroup, create_group, parse_dtype
from relax_gym.errors import StartupError
from relax_gym.tools.formats import tool_format_of
from relax_gym.version import __version__
from relax_gym.video import Video
from relax_gym.web import serve as web_serve
from relax_gym.web.address import is_loopback
from relax_gym.web.errors import error_response, install_error_handlers
from relax_gym.web.guard import Guard
from relax_gym.web.keys import ENGINE_KEY_ENV, announce_generated_key, resolve_server_key

logger = logging.getLogger("relax_gym.engines")
T = TypeVar("T")

#: the bound of every count a request gives (a vocabulary, a token budget): what a 32-bit field holds
MAX_INT32 = 2**31 - 1
#: routes anyone may call: liveness and what model is served (as SGLang leaves them open under --api-key)
OPEN_ROUTES = frozenset({"/health", "/health_generate", "/model_info", "/get_model_info"})
#: where a refused client finds the key (the 401 says it)
KEY_HINT = (f"the key the server printed when it started, or the {ENGINE_KEY_ENV} it was started with; relax_gym's "
            f"clients read ${ENGINE_KEY_ENV}")

# SGLang sampling params accepted only at their neutral value: anything else would be silently ignored.
NEUTRAL_SAMPLING = {
    "n": 1,
    "min_new_tokens": 0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "min_p": 0.0,
    "ignore_eos": False,
    "spaces_between_special_tokens": True,
}
MAX_STOPS = 32
MAX_STOP_CHARS = 256
#: media decoded at once: each decode holds a full-size image, so this bounds their memory together
MEDIA_DECODERS = 2


class BadRequest(ValueError):
    """A request field that cannot be used; answered with 400 and this message."""


def _utf8(value: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"), which no tokenizer or encoder takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"not valid UTF-8 text (a lone surrogate at position {err.start})") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]


class SamplingIn(BaseModel):
    """SGLang's sampling params. Counts and flags are strict (`true` is not 1, `"5"` is not 5): a client that
    sends the wrong type hears so instead of being read as it did not mean."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    temperature: StrictFloat = Field(1.0, ge=0)
    top_p: StrictFloat = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(-1, ge=-1, le=MAX_INT32)
    max_new_tokens: StrictInt = Field(128, ge=0, le=MAX_INT32)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=1024)
    skip_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    sampling_seed: StrictInt | None = Field(None, ge=0, lt=2**63)

    @model_validator(mode="after")
    def _only_neutral_extras(self) -> SamplingIn:
        for name, value in (self.model_extra or {}).items():
            if name not in NEUTRAL_SAMPLING:
                raise ValueError(f"unknown sampling parameter {name!r}")
            if value != NEUTRAL_SAMPLING[name]:
                raise ValueError(f"{name}={value!r} is not supported (only {NEUTRAL_SAMPLING[name]!r})")
        stops = _listed(self.stop)
        if len(stops) > MAX_STOPS or any(not 0 < len(x) <= MAX_STOP_CHARS for x in stops):
            raise ValueError(f"stop: at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} characters")
        return self

    def to_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            max_new_tokens=self.max_new_tokens,
            stop=tuple(_listed(self.stop)),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            seed=self.sampling_seed,
        )


class GenerateIn(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    text: Text | None = None
    input_ids: list[StrictInt] | None = None
    image_data: str | list[str] | None = None
    audio_data: str | list[str] | None = None
    video_data: str | list[str] | None = None
    sampling_params: SamplingIn = Field(default_factory=SamplingIn)
    return_logprob: StrictBool = False
    logprob_start_len: StrictInt = -1
    rid: Annotated[Text, Field(max_length=256)] | None = None
    stream: StrictBool = False
    return_routed_experts: StrictBool = False
    #: SGLang's: the name of a loaded LoRA adapter to run on (`/load_lora_adapter`); None: the base
    lora_path: Annotated[Text, Field(max_length=256)] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateIn:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if self.stream:
            raise ValueError("stream=true is not supported by this server")
        return self


class UpdateIn(BaseModel):
    """What every weight update takes."""

    weight_version: int | Text | None = None
    flush_cache: bool = True


class UpdateOptionsIn(UpdateIn):
    """SGLang's further options of the tensor and distributed updates, accepted at their defaults only."""

    abort_all_requests: bool = False
    load_format: Text | None = None

    @model_validator(mode="after")
    def _defaults_only(self) -> UpdateOptionsIn:
        if self.load_format is not None:
            raise ValueError(f"load_format: only the default (SGLang's flattened buckets are not read), got "
                             f"{self.load_format!r}")
        if self.abort_all_requests:
            raise ValueError("abort_all_requests: only false (pause the server first; the running batch finishes "
                             "before the update)")
        return self


class UpdateFromDiskIn(UpdateIn):
    model_path: Text


class LoadAdapterIn(BaseModel):
    """SGLang's `/load_lora_adapter`: a PEFT adapter folder on the server's disk, loaded under `lora_name`."""

    lora_name: Annotated[Text, Field(min_length=1, max_length=256)]
    lora_path: Text
    #: SGLang keeps a pinned adapter in GPU memory; every adapter here is resident, so it is accepted and moot
    pinned: StrictBool = False


class UnloadAdapterIn(BaseModel):
    lora_name: Annotated[Text, Field(min_length=1, max_length=256)]


class UpdateFromTensorIn(UpdateOptionsIn):
    safetensors_b64: str | None = None
    #: SGLang's: one entry per tensor-parallel rank (this server is one rank), `tensor_ipc`'s pickles
    serialized_named_tensors: list[str] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_payload(self) -> UpdateFromTensorIn:
        if (self.safetensors_b64 is None) == (self.serialized_named_tensors is None):
            raise ValueError("give exactly one of serialized_named_tensors (SGLang's: tensors shared on this host) "
                             "and safetensors_b64 (base64 of a safetensors file of {name: tensor})")
        return self


GroupName = Annotated[Text, Field(min_length=1, max_length=256)]
#: SGLang's default group name, used when a body names none
DEFAULT_GROUP = "weight_update_group"


class InitGroupIn(BaseModel):
    master_address: Annotated[Text, Field(min_length=1, max_length=256)]
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: GroupName = DEFAULT_GROUP
    backend: Text = "nccl"

    @model_validator(mode="after")
    def _rank_in_group(self) -> InitGroupIn:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset: {self.rank_offset} is not a rank of a group of {self.world_size} "
                             "(rank 0 is the trainer)")
        return self


class UpdateFromDistributedIn(UpdateOptionsIn):
    names: list[Text] = Field(min_length=1)
    dtypes: list[Text]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    group_name: GroupName = DEFAULT_GROUP

    @model_validator(mode="after")
    def _aligned(self) -> UpdateFromDistributedIn:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names, dtypes, shapes: {len(self.names)}, {len(self.dtypes)} and {len(self.shapes)} "
                             "items; one of each per tensor")
        if len(set(self.names)) != len(self.names):
            raise ValueError("names: a name is listed twice")
        return self


class DestroyGroupIn(BaseModel):
    group_name: GroupName = DEFAULT_GROUP


class PauseIn(BaseModel):
    mode: Literal["abort", "in_place", "retract"] = "abort"


class BeginWeightUpdateIn(BaseModel):
    """SGLang 0.5.21+'s /begin_weight_update body: which model's weights (this server has only the target)."""

    selector: Literal["target", "all"] = "all"


#: SGLang 0.5.21+'s rule, in its words: a tensor or distributed update runs inside a weight-update session
OUTSIDE_SESSION = "{route} must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"


#: why an update that asks for a cache flush is refused while requests run
UNFLUSHABLE = ("flush_cache: requests are running, so the cache cannot be flushed after the update (SGLang before "
               "0.5.22 fails an assertion in its scheduler here, later ones fail the update): pause in abort mode "
               "and flush first, or send flush_cache: false")


def _listed(value: str | list[str] | None) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _refused(message: str) -> JSONResponse:
    """SGLang's answer to a weight route that did not succeed."""
    return JSONResponse({"success": False, "message": message}, status_code=400)


def _version(value: int | str | None, current: int) -> int:
    """The update's integer version: given, or one past `current`; never below `current`."""
    if value is None:
        return current + 1
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"weight_version: expected a non-negative integer (or a string of one), got {value!r}")
    if value < current:
        raise BadRequest(f"weight_version: {value} is older than the served weights' {current}; versions only go "
                         "up (restart the server to serve older weights)")
    return value


def _decode_media(body: GenerateIn, limits: ServerLimits, model: str, modalities: tuple[str, ...]
                  ) -> tuple[list[Image.Image], list[tuple[np.ndarray, int]], list[Video]]:
    """The request's media, decoded under the limits; media the model cannot take are refused before any decoding
    (a decompression bomb sent to a text model costs nothing)."""
    images, audios, videos = _listed(body.image_data), _listed(body.audio_data), _listed(body.video_data)
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
        items = len(_listed(getattr(body, field)))
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


async def _dialable(address: str, client: str | None) -> bool:
    """Whether `address` resolves to loopback only, or to the asking client's own host."""
    try:
        found = await asyncio.get_running_loop().getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    hosts = {str(info[4][0]) for info in found}
    return bool(hosts) and all(is_loopback(h) or h == client for h in hosts)


async def _unless_gone(request: Request, work: Awaitable[T], displaced: asyncio.Event) -> T | None:
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


def _queue_full(queue: QueueShare) -> JSONResponse:
    return error_response(503, f"the server holds {queue.held} samples, its limit (max_pending), in requests no "
                               "larger than this one: retry later", {"Retry-After": "1"})


def _displaced(queue: QueueShare, slots: int) -> JSONResponse:
    return error_response(503, f"displaced by a smaller request: the queue was full (max_pending {queue.capacity} "
                               f"samples) and its largest requests yield; this one held {slots}: retry later, or ask "
                               "for fewer samples (n)", {"Retry-After": "1"})


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


def create_app(engine: EmbeddedEngine, *, api_key: str | None, limits: ServerLimits | None = None) -> FastAPI:
    """SGLang's native routes over `engine` (the caller owns and closes it), behind `Guard`.

    `api_key=None` turns authentication off: only for a process whose port no one else can reach."""
    limits = limits or ServerLimits()
    app = FastAPI(title="relax_gym embedded engine (SGLang-native API)")
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes, open_routes=OPEN_ROUTES,
                       key_hint=KEY_HINT, cap_hint="max_body_mb")
    install_error_handlers(app)
    name = engine.loaded.name
    context = limits.context_length or engine.context_length
    per_token = engine.loaded.max_token_chars
    decoders = asyncio.Semaphore(MEDIA_DECODERS)
    queue = QueueShare(limits.max_pending)
    groups: dict[str, WeightGroup] = {}  # weights update groups by name, as SGLang keeps them
    joining: set[str] = set()  # names whose /init_weights_update_group is waiting for the other ranks
    session = {"open": False}  # SGLang 0.5.21+'s weight-update session: tensor and distributed updates need one
    model_numel = sum(t.numel() for t in engine.model.state_dict().values())

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        status = 400 if isinstance(exc, RequestError) else 500 if await engine.health() else 503
        return error_response(status, str(exc))

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

    @app.post("/generate")
    async def generate(body: GenerateIn, request: Request) -> Any:
        hold = queue.take(1)
        if hold is None:
            return _queue_full(queue)
        try:
            started = time.perf_counter()
            out = await _unless_gone(
                request, engine.generate(await to_request(body), timeout_s=limits.request_timeout_s), hold.displaced
            )
            if out is None:
                return Response(status_code=499)  # nobody reads it: the client has gone
            return _answer(engine, body, out, started, limits.request_timeout_s)
        finally:
            queue.give_back(hold)

    @app.post("/update_weights_from_disk")
    async def update_from_disk(body: UpdateFromDiskIn) -> JSONResponse:
        return await _update(body.model_path, body.weight_version, body.flush_cache)

    def _adapters_answer(error: str | None = None) -> JSONResponse:
        """SGLang's answer to both adapter routes: success, its error, and the adapters loaded by name."""
        return JSONResponse({"success": error is None, "error_message": error,
                             "loaded_adapters": dict(engine.adapters.folders)}, status_code=400 if error else 200)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterIn) -> JSONResponse:
        """Loads a PEFT adapter folder (safetensors only) by name, beside the base and the adapters loaded."""
        try:
            await engine.load_adapter(body.lora_name, body.lora_path)
        except RequestError as err:
            return _adapters_answer(str(err))
        return _adapters_answer()

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapterIn) -> JSONResponse:
        try:
            await engine.unload_adapter(body.lora_name)
        except RequestError as err:
            return _adapters_answer(str(err))
        return _adapters_answer()

    @app.post("/begin_weight_update")
    async def begin_weight_update(body: BeginWeightUpdateIn) -> JSONResponse:
        """Opens the session, as SGLang 0.5.21+ does; it neither pauses nor flushes (pause first for that)."""
        if session["open"]:
            return _refused(SESSION_OPEN)
        session["open"] = True
        return JSONResponse({"success": True, "message": "Weight update session started."})

    @app.post("/end_weight_update")
    async def end_weight_update() -> JSONResponse:
        if not session["open"]:
            return _refused(NO_SESSION)
        session["open"] = False
        return JSONResponse({"success": True, "message": "Weight update session ended."})

    def _outside_session(route: str) -> JSONResponse | None:
        """SGLang 0.5.21+'s refusal of a tensor or distributed update outside a session, else None."""
        return None if session["open"] else _refused(OUTSIDE_SESSION.format(route=route))

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(body: UpdateFromTensorIn) -> JSONResponse:
        if (refusal := _outside_session("update_weights_from_tensor")) is not None:
            return refusal
        if body.serialized_named_tensors is not None:
            try:  # the sender's memory: `_update` copies it into the model before answering
                tensors = await asyncio.to_thread(tensor_ipc.load, body.serialized_named_tensors[0])
            except ValueError as err:
                raise BadRequest(f"serialized_named_tensors: {err}") from None
            return await _update(tensors, body.weight_version, body.flush_cache)
        assert body.safetensors_b64 is not None  # UpdateFromTensorIn's validator: exactly one payload
        try:
            tensors = load_safetensors(base64.b64decode(body.safetensors_b64, validate=True))
        except Exception as err:
            raise BadRequest(f"safetensors_b64: not base64 of a safetensors file: {err}") from err
        return await _update(tensors, body.weight_version, body.flush_cache)

    async def _update(weights: Any, version: int | str | None, flush_cache: bool) -> JSONResponse:
        if flush_cache and engine.busy:  # SGLang flushes after the update and cannot while requests run
            return JSONResponse({"success": False, "message": UNFLUSHABLE}, status_code=400)
        try:
            await engine.update_weights(weights, _version(version, engine.weight_version))
        except (RequestError, BadRequest) as err:
            return JSONResponse({"success": False, "message": str(err)}, status_code=400)
        message = f"Succeeded to update model weights (weight_version {engine.weight_version})."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    @app.post("/init_weights_update_group")
    async def init_group(body: InitGroupIn, request: Request) -> JSONResponse:
        """Blocks until the trainer (rank 0) and every other rank have joined, or the group's timeout. The group's
        store is dialled only on this machine or on the host that asked: the key does not make the server a
        client of any address a caller names."""
        name = body.group_name
        if not await _dialable(body.master_address, request.client.host if request.client else None):
            return _refused(f"master_address: {body.master_address!r} is neither this machine nor the client that "
                            "asks (the trainer rank hosts the group's store)")
        if name in groups or name in joining:
            return _refused(f"group_name: a group named {name!r} exists; destroy it first")
        if body.backend == "nccl" and engine.device.type != "cuda":
            return _refused(f"backend: 'nccl' needs the model on a CUDA device, it is on {engine.device}; use 'gloo'")
        joining.add(name)
        try:
            groups[name] = await asyncio.to_thread(
                create_group, body.master_address, body.master_port, body.rank_offset, body.world_size, name,
                body.backend,
            )
        except Exception as err:  # a bad backend, an unreachable master, the group's timeout
            return _refused(f"Failed to join weights update group {name!r}: {err}")
        finally:
            joining.discard(name)
        return JSONResponse({"success": True, "message": f"Joined weights update group {name!r} as rank "
                                                         f"{body.rank_offset} of {body.world_size}."})

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(body: UpdateFromDistributedIn) -> JSONResponse:
        """Receives every tensor, then loads them as /update_weights_from_tensor does: a refusal after receiving
        (a name, shape or version the model does not take) leaves the group in step for the next update.

        What is refused before receiving leaves the trainer's broadcast unanswered: destroy the group then."""
        if (refusal := _outside_session("update_weights_from_distributed")) is not None:
            return refusal
        group = _group(body.group_name)
        try:
            dtypes = [parse_dtype(name) for name in body.dtypes]
        except ValueError as err:
            raise BadRequest(f"dtypes: {err}") from None
        if (numel := sum(math.prod(shape) for shape in body.shapes)) > model_numel:
            raise BadRequest(f"shapes: {numel} elements in all, more than the model's {model_numel}")
        device = torch.device("cpu") if group.backend == "gloo" else engine.device
        try:
            tensors = await asyncio.to_thread(group.receive, list(zip(body.shapes, dtypes, strict=True)), device)
        except Exception as err:  # the trainer went away, or the group's timeout
            raise EngineError(f"receiving from group {body.group_name!r} failed ({err}); no weights were changed. "
                              "Destroy the group and make it again.") from err
        return await _update(dict(zip(body.names, tensors, strict=True)), body.weight_version, body.flush_cache)

    @app.post("/destroy_weights_update_group")
    async def destroy_group(body: DestroyGroupIn) -> JSONResponse:
        group = _group(body.group_name)
        del groups[body.group_name]
        await asyncio.to_thread(group.destroy)
        return JSONResponse({"success": True, "message": f"Destroyed weights update group {body.group_name!r}."})

    def _group(name: str) -> WeightGroup:
        if name not in groups:
            known = ", ".join(repr(n) for n in groups) or "none"
            raise BadRequest(f"group_name: no weights update group named {name!r} (groups: {known}); "
                             "make it with /init_weights_update_group")
        return groups[name]

    @app.post("/pause_generation")
    async def pause(body: PauseIn | None = None) -> dict[str, Any]:
        mode = "abort" if body is None else body.mode
        if mode == "retract":
            raise BadRequest("mode: 'retract' is not supported here; 'abort' (the default) or 'in_place'")
        await engine.pause(abort=mode == "abort")
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume() -> dict[str, Any]:
        await engine.resume()
        return {"success": True, "message": "Generation continued."}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        """SGLang's answer: 200, or 400 while requests are running (queued ones of a paused server do not count)."""
        if engine.busy:
            return PlainTextResponse("Cache not flushed: requests are running.", status_code=400)
        return PlainTextResponse("Cache flushed.")

    @app.get("/health")
    async def health() -> PlainTextResponse:
        ok = await engine.health()
        return PlainTextResponse("" if ok else "engine is closed", status_code=200 if ok else 503)

    @app.get("/health_generate")
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

    @app.get("/model_info")
    @app.get("/get_model_info")  # SGLang's older name, which it still answers
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

    tool_format = tool_format_of(engine.loaded)

    def images_of_request() -> Callable[[str, str], Image.Image]:
        """A chat's image reader: the model's modalities, the item cap and one media budget for the request."""
        read = image_reader(engine.loaded.name, engine.loaded.modalities, max_pixels=limits.max_image_pixels,
                            max_items=limits.max_media_items, max_bytes=limits.max_media_bytes)

        def image_of(url: str, where: str) -> Image.Image:
            try:
                return read(url, where)
            except MediaError as err:
                raise BadRequest(str(err)) from None

        return image_of

    async def completed(body: ChatCompletionIn, request: Request) -> dict[str, Any] | Response:
        """The chat completion of `body` under the queue's share, or the answer that says why there is none."""
        hold = queue.take(body.n)
        if hold is None:
            return _queue_full(queue)
        # vLLM's way: a `model` naming a loaded adapter runs on it (the base's name, or none, on the base)
        adapter = body.model if body.model in engine.adapters.folders else None
        try:
            answer = await _unless_gone(request, chat_completion(
                engine, engine.loaded, body, tool_format=tool_format, decode_image=images_of_request(),
                model_name=adapter or name, context=context, timeout_s=limits.request_timeout_s, adapter=adapter),
                hold.displaced)
        finally:
            queue.give_back(hold)
        if hold.displaced.is_set():
            return _displaced(queue, body.n)
        return Response(status_code=499) if answer is None else answer

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionIn, request: Request) -> Any:
        """OpenAI's chat completions on the served model (`relax_gym.engines.openai_api`)."""
        answer = await completed(body, request)
        if body.stream and not isinstance(answer, Response):
            return StreamingResponse(stream_events(answer), media_type="text/event-stream")
        return answer

    @app.post("/v1/responses")
    async def responses(body: ResponsesIn, request: Request) -> Any:
        """OpenAI's Responses API, as a chat completion (`relax_gym.engines.responses_api`)."""
        return respond(await completed(to_chat(body), request), body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        served = [{"id": name, "object": "model", "created": 0, "owned_by": "relax-gym"}]
        served += [{"id": adapter, "object": "model", "created": 0, "owned_by": "relax-gym", "parent": name,
                    "root": folder} for adapter, folder in engine.adapters.folders.items()]
        return {"object": "list", "data": served}

    @app.get("/server_info")
    @app.get("/get_server_info")  # SGLang's older name, which it still answers
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

    return app


async def load_adapters(engine: EmbeddedEngine, adapters: Mapping[str, str]) -> None:
    """Loads each adapter folder under its name; a StartupError names the first that does not load."""
    for name, folder in adapters.items():
        try:
            await engine.load_adapter(name, folder)
        except RequestError as err:
            raise StartupError(f"relax-gym serve --lora-paths {name}={folder}: {err}") from None


def uvicorn_config(app: Any, host: str, port: int, limits: ServerLimits, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's settings for `app` under `limits`: the read deadline, connection cap and SIGTERM drain."""
    return web_serve.uvicorn_config(app, host, port, limits.bounds, drain_timeout_s=limits.drain_timeout_s, **kwargs)


def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    device: str = "auto",
    api_key_file: str | os.PathLike | None = None,
    limits: ServerLimits | None = None,
    adapters: Mapping[str, str] | None = None,
    **engine_kwargs: Any,
) -> None:
    """Loads `model` (a tiny model name or a local HF folder) and serves it until interrupted or SIGTERM
    (requests in flight get `drain_timeout_s` to finish, then are aborted). `device` as `rollout.engine_device`
    takes it: "auto" is the first GPU (in bfloat16) where torch sees one, else the CPU. `adapters` (name ->
    PEFT adapter folder) are loaded before it serves; one that does not load stops it, naming it."""
    from relax_gym.models import load_model

    limits = limits or ServerLimits()
    api_key, generated = resolve_server_key(host, api_key_file, ENGINE_KEY_ENV)
    if not is_loopback(host):
        logger.warning("serving on %s: reachable beyond this machine over plain HTTP, so the API key travels in "
                       "clear; put TLS (a reverse proxy) or an SSH tunnel in front", host)
    engine = EmbeddedEngine(load_model(model), device=engine_device(device), **engine_kwargs)
    try:
        asyncio.run(load_adapters(engine, adapters or {}))
    except BaseException:
        asyncio.run(engine.close())
        raise
    if generated:
        announce_generated_key(api_key, ENGINE_KEY_ENV)
    try:
        uvicorn.Server(uvicorn_config(create_app(engine, api_key=api_key, limits=limits), host, port, limits,
                                      log_level="info")).run()
    finally:
        asyncio.run(engine.close())
