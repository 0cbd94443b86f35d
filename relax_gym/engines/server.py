"""The embedded engine behind SGLang's native HTTP routes (`relax-gym serve`).

The same `SGLangEngine` client then drives a real SGLang server or this one, so
the client is tested over real HTTP on any machine, and CPU rollout workers can
share one served model. What differs from SGLang, by necessity:

- `/generate` takes one request per call (they are batched server-side); its
  `input_ids` must already hold the expanded image / audio placeholders, as
  `relax_gym.models.render` gives them. Only output logprobs are returned
  (`logprob_start_len` is accepted, input logprobs are not computed).
  `image_data` / `audio_data` items are data URLs, bare base64 or local paths.
- `/update_weights_from_tensor` takes `{"safetensors_b64": <base64 of a
  safetensors file>, "weight_version": ...}`: SGLang's own payload is pickled
  CUDA IPC handles, meaningless across processes without its runtime.
- `/update_weights_from_distributed` answers 501: there is no NCCL group here.
- `/pause_generation` lets the running batch finish; queued requests wait.
- `weight_version` is a string of the engine's integer version, as SGLang's is a string.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, model_validator
from safetensors.torch import load as load_safetensors

from relax_gym import __version__
from relax_gym.engines.base import EngineError, GenerateOutput, GenerateRequest, RequestError, SamplingParams
from relax_gym.engines.embedded import EmbeddedEngine

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


class BadRequest(ValueError):
    """A request field that cannot be used; answered with 400 and this message."""


class SamplingIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: int = Field(128, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @model_validator(mode="after")
    def _only_neutral_extras(self) -> SamplingIn:
        for name, value in (self.model_extra or {}).items():
            if name not in NEUTRAL_SAMPLING:
                raise ValueError(f"unknown sampling parameter {name!r}")
            if value != NEUTRAL_SAMPLING[name]:
                raise ValueError(f"{name}={value!r} is not supported (only {NEUTRAL_SAMPLING[name]!r})")
        return self

    def to_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            max_new_tokens=self.max_new_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            seed=self.sampling_seed,
        )


class GenerateIn(BaseModel):
    text: str | None = None
    input_ids: list[int] | None = None
    image_data: str | list[str] | None = None
    audio_data: str | list[str] | None = None
    sampling_params: SamplingIn = Field(default_factory=SamplingIn)
    return_logprob: bool = False
    logprob_start_len: int = -1
    rid: str | None = None
    stream: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateIn:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if self.stream:
            raise ValueError("stream=true is not supported by this server")
        return self


class UpdateFromDiskIn(BaseModel):
    model_path: str
    weight_version: int | str | None = None


class UpdateFromTensorIn(BaseModel):
    safetensors_b64: str | None = None
    serialized_named_tensors: Any = None
    weight_version: int | str | None = None


class PauseIn(BaseModel):
    mode: str = "in_place"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def _media_bytes(item: str, where: str) -> bytes:
    """A data URL, bare base64 or a local path, as bytes."""
    if item.startswith(("http://", "https://")):
        raise BadRequest(f"{where}: URLs are not fetched by this server; send base64 or a local path")
    if item.startswith("data:"):
        item = item.partition(",")[2]
    elif len(item) < 4096 and Path(item).is_file():
        return Path(item).read_bytes()
    try:
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError) as err:
        raise BadRequest(f"{where}: not a data URL, base64 or an existing local file") from err


def _image(item: str, where: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(_media_bytes(item, where)))
        image.load()
    except OSError as err:
        raise BadRequest(f"{where}: cannot decode an image: {err}") from err
    return image


def _audio(item: str, where: str) -> tuple[np.ndarray, int]:
    try:
        wave, rate = soundfile.read(io.BytesIO(_media_bytes(item, where)), dtype="float32")
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as err:
        raise BadRequest(f"{where}: cannot decode audio (WAV, FLAC or OGG expected): {err}") from err
    return (wave.mean(axis=1) if wave.ndim == 2 else wave), int(rate)


def _listed(value: str | list[str] | None) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _version(value: int | str | None, current: int) -> int:
    if value is None:
        return current + 1
    if isinstance(value, int) or value.strip().lstrip("-").isdigit():
        return int(value)
    raise BadRequest(f"weight_version: expected an integer (or a string of one), got {value!r}")


def _decode_media(body: GenerateIn) -> tuple[list[Image.Image], list[tuple[np.ndarray, int]]]:
    images = [_image(x, f"image_data[{i}]") for i, x in enumerate(_listed(body.image_data))]
    audios = [_audio(x, f"audio_data[{i}]") for i, x in enumerate(_listed(body.audio_data))]
    return images, audios


async def _to_request(engine: EmbeddedEngine, body: GenerateIn) -> GenerateRequest:
    images, audios = await asyncio.to_thread(_decode_media, body)
    if body.input_ids is not None:
        return GenerateRequest(body.input_ids, body.sampling_params.to_params(), images, audios, rid=body.rid)
    ids, media = await asyncio.to_thread(engine.encode, body.text, images, audios)
    return GenerateRequest(ids, body.sampling_params.to_params(), images, audios, media or None, body.rid)


def _finish_reason(engine: EmbeddedEngine, out: GenerateOutput, params: SamplingParams) -> dict[str, Any]:
    """SGLang's finish_reason object: what matched for "stop", the length for "length"."""
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.output_ids)}
    if out.finish_reason == "abort":
        return {"type": "abort", "message": "aborted: the engine closed or the request was cancelled"}
    last = out.output_ids[-1]
    if last in engine.eos_token_ids or last in params.stop_token_ids:
        return {"type": "stop", "matched": last}
    text = engine.loaded.tokenizer.decode(out.output_ids, skip_special_tokens=False)
    return {"type": "stop", "matched": next((s for s in params.stop if s in text), None)}


def _answer(engine: EmbeddedEngine, body: GenerateIn, out: GenerateOutput, started: float) -> dict[str, Any]:
    params = body.sampling_params.to_params()
    finish = _finish_reason(engine, out, params)
    tokenizer = engine.loaded.tokenizer
    text = tokenizer.decode(out.output_ids, skip_special_tokens=body.sampling_params.skip_special_tokens)
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
    return {"text": text, "output_ids": out.output_ids, "meta_info": meta}


def create_app(engine: EmbeddedEngine) -> FastAPI:
    """SGLang's native routes over `engine`; the caller owns (and closes) the engine."""
    app = FastAPI(title="relax_gym embedded engine (SGLang-native API)")
    name = engine.loaded.name

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        fields = [
            f"{'.'.join(str(p) for p in err['loc'] if p != 'body') or 'body'}: {err['msg']}" for err in exc.errors()
        ]
        return _error(400, "; ".join(fields))

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        status = 400 if isinstance(exc, RequestError) else 500 if await engine.health() else 503
        return _error(status, str(exc))

    @app.post("/generate")
    async def generate(body: GenerateIn) -> dict[str, Any]:
        started = time.perf_counter()
        out = await engine.generate(await _to_request(engine, body))
        return _answer(engine, body, out, started)

    @app.post("/update_weights_from_disk")
    async def update_from_disk(body: UpdateFromDiskIn) -> JSONResponse:
        return await _update(body.model_path, body.weight_version)

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(body: UpdateFromTensorIn) -> JSONResponse:
        if body.safetensors_b64 is None:
            raise BadRequest(
                "safetensors_b64: required (base64 of a safetensors file of {name: tensor}); SGLang's "
                "serialized_named_tensors (pickled CUDA IPC handles) cannot be read by this server"
            )
        try:
            tensors = load_safetensors(base64.b64decode(body.safetensors_b64, validate=True))
        except Exception as err:
            raise BadRequest(f"safetensors_b64: not base64 of a safetensors file: {err}") from err
        return await _update(tensors, body.weight_version)

    async def _update(weights: Any, version: int | str | None) -> JSONResponse:
        try:
            await engine.update_weights(weights, _version(version, engine.weight_version))
        except RequestError as err:
            return JSONResponse({"success": False, "message": str(err)}, status_code=400)
        message = f"Succeeded to update model weights (weight_version {engine.weight_version})."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed() -> JSONResponse:
        message = (
            "update_weights_from_distributed needs an NCCL group with the trainer, which the embedded "
            "engine does not have; use /update_weights_from_disk or /update_weights_from_tensor"
        )
        return JSONResponse({"success": False, "message": message}, status_code=501)

    @app.post("/pause_generation")
    async def pause(body: PauseIn | None = None) -> dict[str, Any]:
        if body is not None and body.mode != "in_place":
            raise BadRequest(f"mode: only 'in_place' is supported (the running batch finishes), got {body.mode!r}")
        await engine.pause()
        return {"success": True, "message": "Generation paused."}

    @app.post("/continue_generation")
    async def resume() -> dict[str, Any]:
        await engine.resume()
        return {"success": True, "message": "Generation continued."}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        return PlainTextResponse("Cache flushed (the embedded engine keeps no cache between batches).")

    @app.get("/health")
    async def health() -> PlainTextResponse:
        ok = await engine.health()
        return PlainTextResponse("" if ok else "engine is closed", status_code=200 if ok else 503)

    @app.get("/health_generate")
    async def health_generate() -> PlainTextResponse:
        if engine.paused:
            return PlainTextResponse("generation is paused", status_code=503)
        probe = GenerateRequest([engine.pad_token_id], SamplingParams(temperature=0, max_new_tokens=1))
        await asyncio.wait_for(engine.generate(probe), timeout=60)
        return PlainTextResponse("")

    @app.get("/get_model_info")
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
            "modalities": list(modalities),
        }

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "version": __version__,
            "backend": "relax_gym embedded (transformers)",
            "model_path": name,
            "device": str(engine.device),
            "dtype": str(engine.model.dtype).removeprefix("torch."),
            "max_batch_size": engine.max_batch_size,
            "paused": engine.paused,
            "weight_version": str(engine.weight_version),
        }

    return app


def serve(model: str, host: str = "127.0.0.1", port: int = 30000, *, device: str = "cpu", **engine_kwargs: Any) -> None:
    """Loads `model` (a tiny model name or a local HF folder) and serves it until interrupted."""
    import uvicorn

    from relax_gym.models import load_model

    engine = EmbeddedEngine(load_model(model, device=device), **engine_kwargs)
    try:
        uvicorn.run(create_app(engine), host=host, port=port, log_level="info")
    finally:
        asyncio.run(engine.close())
