"""`relax-gym serve` under attack: each attack from the security review, replayed over real HTTP on loopback.

Every one is refused with a 4xx naming the field, contained, or cannot happen; none needs a person to
kill a process. A slowed model (a forward pre-hook that sleeps) stands in for a long generation, so a
request that would run for minutes is a fact of the test, not of the machine's speed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import wave
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save
from support.engines import AUTH, KEY, free_port, get, post, serving, weight_session

from relax_gym.engines import RequestError, SGLangEngine
from relax_gym.engines.base import API_KEY_ENV
from relax_gym.engines.server_limits import ServerLimits
from relax_gym.models import load_model

LIMITS = ServerLimits(max_body_mb=1, read_timeout_s=1.0, request_timeout_s=3.0, max_pending=3, health_timeout_s=1.0)
STEP_S = 0.02  # each forward pass of the slowed model sleeps this long: 4000 tokens take over a minute
LONG = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4000, "temperature": 0}}
SHORT = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def _slowed(loaded):
    loaded.model.register_forward_pre_hook(lambda *_: time.sleep(STEP_S))
    return loaded


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, object]]:
    with serving(_slowed(load_model("tiny")), limits=LIMITS) as (url, engine):
        yield url, engine


#: a long request timeout: only the client going away ends a long request here
PATIENT = ServerLimits(request_timeout_s=600.0, max_pending=3)


@pytest.fixture(scope="module")
def patient() -> Iterator[tuple[str, object]]:
    with serving(_slowed(load_model("tiny")), limits=PATIENT) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def media_url() -> Iterator[str]:
    """A server of a model that takes images, audio and video, for the media checks past the modality check (the
    text model refuses every medium before decoding it)."""
    with serving(load_model("tiny-omni"), limits=LIMITS) as (media, _):
        yield media


def _message(response: httpx.Response) -> str:
    body = response.json()
    return (body.get("error") or {}).get("message") or body.get("message") or ""


def _until(condition, what: str, bound_s: float = 30.0) -> None:
    """Polls `condition`; the bound only says the test did not hang."""
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _pending(url: str) -> int:
    return get(f"{url}/get_server_info", timeout=10).json()["pending_requests"]


def _png(width: int, height: int) -> bytes:
    """A real grayscale PNG of zeros: a few hundred KB that decode to width x height bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer = zlib.compressobj(9)
    row = b"\0" * (width + 1)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


# --- the API key ---------------------------------------------------------------------------------

MUTATING = [
    ("POST", "/generate", SHORT),
    ("POST", "/update_weights_from_tensor", {"safetensors_b64": "", "weight_version": 9}),
    ("POST", "/update_weights_from_disk", {"model_path": "/tmp"}),
    ("POST", "/pause_generation", {"mode": "in_place"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/flush_cache", None),
    ("GET", "/get_server_info", None),
    ("GET", "/openapi.json", None),
]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}])
@pytest.mark.parametrize(("method", "route", "body"), MUTATING)
def test_every_route_but_health_and_model_info_needs_the_key(url, method, route, body, headers):
    response = httpx.request(method, f"{url}{route}", json=body, headers=headers, timeout=10)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer" and "API key" in _message(response)


def test_health_and_model_info_are_open(url):
    for route in ("/health", "/get_model_info"):
        assert httpx.get(f"{url}{route}", timeout=10).status_code == 200


def test_weights_do_not_change_without_the_key(server):
    url, engine = server
    norm = engine.model.model.norm.weight.detach().clone()
    blob = base64.b64encode(save({"model.norm.weight": torch.zeros(64)})).decode()
    response = httpx.post(f"{url}/update_weights_from_tensor", json={"safetensors_b64": blob}, timeout=10)
    assert response.status_code == 401
    assert torch.equal(engine.model.model.norm.weight, norm)


def test_the_client_sends_its_key_and_a_missing_one_is_named(url):
    async def use(key: str) -> None:
        client = SGLangEngine(url, api_key=key, timeout_s=10)
        try:
            await client.pause()
            await client.resume()
        finally:
            await client.close()

    asyncio.run(use(KEY))
    with pytest.raises(RequestError, match=r"answered 401 .*API key"):
        asyncio.run(use("wrong"))


# --- weight updates -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tensors", "version", "field"),
    [
        ({"model.norm.weight": torch.full((64,), float("nan"))}, None, "NaN or infinite"),
        ({"model.norm.weight": torch.full((64,), float("inf"))}, None, "NaN or infinite"),
        ({"model.norm.weight": torch.ones(64, dtype=torch.int32)}, None, "dtype torch.int32"),
        ({"model.norm.weight": torch.ones(65)}, None, "shape (65,)"),
        ({"model.norm.weight": torch.ones(64)}, "-5", "weight_version"),
        ({"model.norm.weight": torch.ones(64)}, -5, "weight_version"),
        ({"model.norm.weight": torch.ones(64)}, "1e3", "weight_version"),
    ],
)
def test_bad_weight_updates_are_refused_before_they_touch_the_model(server, tensors, version, field):
    url, engine = server
    norm, before = engine.model.model.norm.weight.detach().clone(), engine.weight_version
    body = {"safetensors_b64": base64.b64encode(save(tensors)).decode(), "weight_version": version}
    with weight_session(url):
        response = post(f"{url}/update_weights_from_tensor", json=body, timeout=30)
    assert response.status_code == 400 and field in _message(response), response.text
    assert torch.equal(engine.model.model.norm.weight, norm) and engine.weight_version == before


def test_a_weights_group_is_joined_only_on_this_machine_or_the_asking_host(url):
    """The key does not make the server dial any address a caller names (and hold the request for the group's
    timeout): a store elsewhere is refused at once."""
    for elsewhere in ("203.0.113.5", "10.255.255.1", "no-such-host.invalid"):
        refused = post(f"{url}/init_weights_update_group", json={"master_address": elsewhere, "master_port": 29500,
                                                                 "rank_offset": 1, "world_size": 2,
                                                                 "backend": "gloo"}, timeout=30)
        assert refused.status_code == 400 and "neither this machine nor the client" in _message(refused)


def test_weight_versions_only_go_up(server):
    url, engine = server
    current = engine.weight_version
    blob = base64.b64encode(save({"model.norm.weight": engine.model.model.norm.weight.detach().clone()})).decode()
    with weight_session(url):
        ok = post(f"{url}/update_weights_from_tensor", json={"safetensors_b64": blob, "weight_version": current + 5},
                  timeout=30)
        assert ok.status_code == 200, ok.text
        older = post(f"{url}/update_weights_from_tensor",
                     json={"safetensors_b64": blob, "weight_version": current + 4}, timeout=30)
    assert older.status_code == 400 and "older than the served weights'" in _message(older)
    assert engine.weight_version == current + 5


# --- what one request may ask -----------------------------------------------------------------------


def _raw_post(url: str, route: str, raw: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    """A body sent as given: JSON that Python's encoder would never write (Infinity, lone surrogates)."""
    return httpx.post(f"{url}{route}", content=raw, timeout=30,
                      headers={**AUTH, "Content-Type": "application/json", **(headers or {})})


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'{"input_ids": [5], "sampling_params": {"max_new_tokens": 1000000000}}', "sampling_params.max_new_tokens"),
        (b'{"input_ids": [5], "sampling_params": {"sampling_seed": 100000000000000000000000}}', "sampling_seed"),
        (b'{"input_ids": [5], "sampling_params": {"sampling_seed": -1}}', "sampling_seed"),
        (b'{"input_ids": [5], "sampling_params": {"top_k": 9223372036854775808}}', "sampling_params.top_k"),
        (b'{"input_ids": [5], "sampling_params": {"max_new_tokens": true}}', "max_new_tokens: Input should be"),
        (b'{"input_ids": [5], "sampling_params": {"max_new_tokens": "5"}}', "max_new_tokens: Input should be"),
        (b'{"input_ids": [5], "return_logprob": 1}', "return_logprob: Input should be a valid boolean"),
        (b'{"input_ids": [5], "sampling_params": {"max_new_tokens": 9223372036854775808}}', "max_new_tokens"),
        (b'{"input_ids": [5], "sampling_params": {"temperature": Infinity}}', "temperature"),
        (b'{"input_ids": [5], "sampling_params": {"temperature": NaN}}', "temperature"),
        (b'{"input_ids": [5], "sampling_params": {"top_p": NaN}}', "top_p"),
        (b'{"text": "a\\ud800b"}', "text: Value error, not valid UTF-8"),
        (b'{"input_ids": [5], "sampling_params": {"stop": ["\\udfff"]}}', "stop"),
        (b'{"input_ids": [5], "rid": "\\ud800"}', "rid"),
        (b'{"input_ids": [5], "sampling_params": {"stop": ["x"], "max_new_tokens": 2}, "rid": "' + b"r" * 300 + b'"}',
         "rid"),
        (b'{"input_ids": [5], "sampling_params": {"stop": ' + json.dumps(["ab"] * 40).encode() + b"}}", "stop"),
        (b'{"input_ids": [5], "sampling_params": {"stop": ["' + b"s" * 300 + b'"]}}', "stop"),
        (b'{"input_ids": ' + json.dumps([5] * 5000).encode() + b"}", "input_ids: the prompt has 5000 tokens"),
        (b'{"text": "' + b"hello " * 5000 + b'"}', "text: the prompt has"),
        (b"[1, 2]", "body"),
        (b"{not json", "body"),
    ],
)
def test_malformed_or_oversized_fields_get_400_naming_them(url, raw, field):
    response = _raw_post(url, "/generate", raw)
    assert response.status_code == 400, response.text
    assert field in _message(response), _message(response)


@pytest.mark.parametrize(("body", "field"), [
    ({"seed": 2**64}, "seed"), ({"seed": 2**63 - 1}, "seed"), ({"n": 2**63}, "n"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_completion_tokens": 2**31}, "max_completion_tokens"),
    ({"n": "2"}, "n: Input should be a valid integer"), ({"max_tokens": True}, "max_tokens"),
])
def test_the_chat_routes_numbers_are_bounded_too(url, body, field):
    response = post(f"{url}/v1/chat/completions", timeout=10,
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
    assert response.status_code == 400 and _message(response).startswith(field), response.text


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize(("chat", "said"), [
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0]: not valid UTF-8"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps(_nested(900))}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]}, "messages[1].tool_calls: nested deeper than 32"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(400)}}]}, "tools: nested deeper"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(_png(8, 8))}},
                                                {"type": "text", "text": "what is it?"}]}]},
     "messages[0].content[0]: model 'tiny' takes text only, not images"),
])
def test_what_a_chat_template_cannot_take_is_a_400_in_one_line_not_a_500(url, chat, said):
    response = _raw_post(url, "/v1/chat/completions", json.dumps({**chat, "max_tokens": 2}).encode())  # \ud800 too
    assert response.status_code == 400 and said in _message(response), response.text
    assert "\n" not in _message(response) and len(_message(response)) < 600


def test_the_chat_route_keeps_generates_bounds_context_and_timeout(url):
    """The prompt and max_tokens must fit the context before any prefill; a chat giving no max_tokens gets what is
    left; the request timeout ends a long chat with its tokens so far, as it ends a /generate."""
    context = httpx.get(f"{url}/get_model_info", timeout=10).json()["context_length"]
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "one two three"} for i in range(1001)]
    crowded = post(f"{url}/v1/chat/completions", json={"messages": many, "max_tokens": 2}, timeout=30)
    assert crowded.status_code == 400 and "messages: the prompt has" in _message(crowded), crowded.text
    huge = post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x " * 500_000}]},
                timeout=30)
    assert huge.status_code == 400 and "characters cannot fit" in _message(huge)
    hi = [{"role": "user", "content": "hi"}]
    past = post(f"{url}/v1/chat/completions", json={"messages": hi, "max_tokens": context}, timeout=30)
    assert past.status_code == 400 and _message(past).startswith("max_tokens: ") and "at most" in _message(past)
    cut = post(f"{url}/v1/chat/completions", json={"messages": hi, "temperature": 0}, timeout=120).json()
    asked = min(512, context - cut["usage"]["prompt_tokens"])  # the default max_tokens, cut to what the context left
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] < asked  # timed out


def test_a_chats_images_have_the_item_cap_and_the_media_budget_of_generate(media_url):
    """40 images gave a 500 on the chat route (no item cap); 21 of the largest grayscale ones pass max_media_mb."""
    def chat(images: list[str]) -> httpx.Response:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in images] + [{"type": "text", "text": "?"}]
        return post(f"{media_url}/v1/chat/completions", timeout=60,
                    json={"messages": [{"role": "user", "content": parts}], "max_tokens": 2})

    many = chat([_data_url(_png(2, 2))] * 40)
    assert many.status_code == 400 and "more than 32 images in one request (max_media_items)" in _message(many)
    heavy = chat([_data_url(_png(3584, 3584))] * 21)
    assert heavy.status_code == 400 and "max_media_mb" in _message(heavy), heavy.text


def test_media_that_miss_the_prompts_placeholders_are_a_400_naming_the_field(media_url):
    """An image with no `<|image_pad|>` in the text, two placeholders for one image, audio with no `<|AUDIO|>`, or
    expanded input_ids with no image run were 500s with a traceback each: the processor's and the model's own checks
    failing inside the server."""
    image = _data_url(_png(8, 8))
    sampling = {"max_new_tokens": 2}
    pad = 1013  # tiny-omni's <|image_pad|> id
    wav = io.BytesIO()
    with wave.open(wav, "wb") as out:
        out.setnchannels(1), out.setsampwidth(2), out.setframerate(16000), out.writeframes(b"\0\0" * 1600)
    audio = "data:audio/wav;base64," + base64.b64encode(wav.getvalue()).decode()
    for body, said in [
        ({"text": "hi", "image_data": image}, "the prompt and its media do not match"),
        ({"text": "<|image_pad|> and <|image_pad|>", "image_data": image}, "the prompt and its media do not match"),
        ({"text": "hi", "audio_data": audio}, "the prompt and its media do not match"),
        ({"input_ids": [1, 2, 3], "image_data": image}, "image_data: 1 item(s), and input_ids hold no image"),
        ({"input_ids": [1, pad, 2]}, "image_data: 0 item(s), and input_ids hold some image"),
        ({"input_ids": [pad, 5, pad], "image_data": image}, "Image features and image tokens do not match"),
    ]:
        response = post(f"{media_url}/generate", json={**body, "sampling_params": sampling}, timeout=60)
        assert response.status_code == 400 and said in _message(response), response.text
        assert "\n" not in _message(response)
    assert post(f"{media_url}/generate", json={"text": "<|image_pad|>", "image_data": image,
                                               "sampling_params": sampling}, timeout=60).status_code == 200


def test_an_images_data_url_is_not_counted_as_text_against_the_context(media_url):
    """The characters bound before the render counts text only: a photo's data URL is longer than the context has
    characters for, and becomes a few dozen image tokens."""
    noise = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(noise, "PNG")
    photo = _data_url(noise.getvalue())
    context = httpx.get(f"{media_url}/get_model_info", timeout=10).json()["context_length"]
    assert len(photo) > context * 32  # past any tokenizer's characters per token
    chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": photo}},
                                                      {"type": "text", "text": "what is it?"}]}], "max_tokens": 2}
    response = post(f"{media_url}/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 200, response.text


def test_a_request_the_sampler_cannot_take_fails_alone_and_the_worker_lives_on(server):
    """Past the schema (a library caller, or a bound missed): the request fails with its error, its batch mates are
    answered, and the engine goes on serving; the worker thread never dies of one request."""
    from relax_gym.engines import EngineError, GenerateRequest, SamplingParams

    url, engine = server

    async def batch() -> list[object]:
        bad = GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=2, temperature=1.0, top_k=2**63), rid="bad")
        seeded = GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=2, seed=2**64), rid="seeded")
        good = GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=2, temperature=0), rid="good")
        return await asyncio.gather(*(engine.generate(r) for r in (bad, seeded, good)), return_exceptions=True)

    bad, seeded, good = asyncio.run(batch())  # the engine answers any caller's loop
    assert isinstance(bad, EngineError) and "bad" in str(bad)
    assert isinstance(seeded, EngineError) and "seeded" in str(seeded)
    assert len(good.output_ids) == 2
    assert get(f"{url}/health", timeout=10).status_code == 200
    assert post(f"{url}/generate", json=SHORT, timeout=30).status_code == 200


def test_max_new_tokens_may_fill_the_context_and_no_more(url):
    context = httpx.get(f"{url}/get_model_info", timeout=10).json()["context_length"]
    fits = {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": context - 10}}
    over = {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": context - 9}}
    assert "at most" in _message(post(f"{url}/generate", json=over, timeout=10))
    # The one that fits is accepted (and then ends at the server's request timeout, see below).
    answer = post(f"{url}/generate", json=fits, timeout=60).json()
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_body_over_the_cap_is_refused_before_it_is_read(url):
    big = b'{"input_ids": [' + b"1," * (1 << 20) + b"1]}"  # 2 MiB against a 1 MiB cap
    response = _raw_post(url, "/generate", big)
    assert response.status_code == 413 and "max_body_mb" in _message(response)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap is counted as the body arrives
        yield b'{"input_ids": ['
        for _ in range(33):
            yield b"1," * 16384

    chunked = httpx.post(f"{url}/generate", content=chunks(), headers={**AUTH, "Content-Type": "application/json"},
                         timeout=30)
    assert chunked.status_code == 413


# --- media --------------------------------------------------------------------------------------


def test_media_a_model_cannot_take_are_refused_before_they_are_decoded(url):
    bomb = _data_url(_png(12_000, 12_000))
    response = post(f"{url}/generate", json={**SHORT, "image_data": [bomb] * 4}, timeout=30)
    assert response.status_code == 400 and "image_data: model 'tiny' takes text only, not images" in _message(response)
    noise = base64.b64encode(os.urandom(64)).decode()
    audio = post(f"{url}/generate", json={**SHORT, "audio_data": [noise]}, timeout=30)
    assert audio.status_code == 400 and "audio_data: model 'tiny' takes text only, not audio" in _message(audio)


def test_server_paths_are_never_read_so_answers_do_not_say_which_files_exist(media_url, tmp_path):
    url = media_url
    real = tmp_path / "real.png"
    Image.new("RGB", (8, 8)).save(real)
    answers = []
    for path in (str(real), str(tmp_path / "missing.png"), "/etc/hostname", "/proc/self/environ"):
        response = post(f"{url}/generate", json={**SHORT, "image_data": [path]}, timeout=10)
        assert response.status_code == 400
        answers.append(_message(response).replace(path, "PATH"))
    assert len(set(answers)) == 1 and "server paths are not read" in answers[0]


def test_a_decompression_bomb_is_refused_from_its_header(media_url):
    url = media_url
    bomb = _png(12_000, 12_000)  # 144 megapixels in ~150 KB
    response = post(f"{url}/generate", json={**SHORT, "image_data": [_data_url(bomb)] * 4}, timeout=30)
    assert response.status_code == 400 and "144000000 pixels" in _message(response), response.text
    assert "max_image_pixels" in _message(response)


def test_images_past_the_item_count_and_undecodable_audio_are_400(media_url):
    url = media_url
    assert "image_data[0]" in _message(_raw_post(url, "/generate", b'{"input_ids": [5], "image_data": ["AAAAAAAA"]}'))
    tiny = _data_url(_png(2, 2))
    many = post(f"{url}/generate", json={**SHORT, "image_data": [tiny] * 33}, timeout=30)
    assert many.status_code == 400 and "max_media_items" in _message(many)
    noise = base64.b64encode(os.urandom(64)).decode()
    audio = post(f"{url}/generate", json={**SHORT, "audio_data": [noise]}, timeout=30)
    assert audio.status_code == 400 and "audio_data[0]: cannot decode audio" in _message(audio)


def test_media_each_within_their_caps_cannot_add_up_past_the_requests_budget(media_url):
    """32 grayscale PNGs of 3584x3584 (each at max_image_pixels, ~13 KB compressed): 411 MB decoded in all, refused
    once the sum passes max_media_mb (256), from the headers, before the item that would pass it decodes."""
    flat = _data_url(_png(3584, 3584))
    response = post(f"{media_url}/generate", json={**SHORT, "image_data": [flat] * 32}, timeout=120)
    assert response.status_code == 400 and "max_media_mb" in _message(response), response.text
    assert _message(response).startswith("image_data[20]: decoding it would bring the request's media to")


def test_images_in_a_format_outside_the_list_are_refused(media_url):
    url = media_url
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="TIFF")
    response = post(f"{url}/generate", json={**SHORT, "image_data": [_data_url(buffer.getvalue())]}, timeout=30)
    assert response.status_code == 400 and "image_data[0]: cannot decode an image" in _message(response)


# --- time: long requests, gone clients, a full queue, health ------------------------------------


def test_a_request_past_the_timeout_ends_with_abort_and_keeps_its_tokens(url):
    answer = post(f"{url}/generate", json={**LONG, "return_logprob": True}, timeout=60).json()
    meta = answer["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and "request_timeout_s" in meta["finish_reason"]["message"]
    assert 0 < len(answer["output_ids"]) < 4000 and len(meta["output_token_logprobs"]) == len(answer["output_ids"])


def test_a_client_that_goes_away_frees_the_server(patient):
    url, engine = patient
    with pytest.raises(httpx.ReadTimeout):  # the client gives up on a request that would run for minutes
        post(f"{url}/generate", json=LONG, timeout=1.0)
    _until(lambda: _pending(url) == 0 and not engine._queue.busy, "the abandoned request is still running")


def test_a_full_queue_answers_503_with_retry_after(patient):
    url, _ = patient
    gave_up: list[bool] = []

    def long_request() -> None:
        with pytest.raises(httpx.ReadTimeout):
            post(f"{url}/generate", json=LONG, timeout=10)
        gave_up.append(True)

    threads = [threading.Thread(target=long_request) for _ in range(PATIENT.max_pending)]
    for thread in threads:
        thread.start()
    _until(lambda: _pending(url) == PATIENT.max_pending, "the long requests did not arrive")
    refused = post(f"{url}/generate", json=SHORT, timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "max_pending" in _message(refused)
    for thread in threads:
        thread.join(60)
    assert gave_up == [True] * PATIENT.max_pending
    _until(lambda: _pending(url) == 0, "the abandoned requests are still held")


def test_a_chat_asking_for_the_whole_queue_yields_to_a_single_generate(patient):
    """The review's attack: chats with a large `n` filled `max_pending` and everyone else got 503 until they ended.
    Now the largest request held yields: it gets 503 naming why, and the one-sample /generate is served."""
    url, _ = patient
    answers: list[httpx.Response] = []
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000, "n": PATIENT.max_pending}
    hog = threading.Thread(target=lambda: answers.append(post(f"{url}/v1/chat/completions", json=chat, timeout=60)))
    hog.start()
    _until(lambda: _pending(url) == PATIENT.max_pending, "the chat did not arrive")
    served = post(f"{url}/generate", json=SHORT, timeout=30)
    assert served.status_code == 200 and len(served.json()["output_ids"]) == 2
    hog.join(60)
    [displaced] = answers
    assert displaced.status_code == 503 and displaced.headers["retry-after"] == "1"
    assert "displaced by a smaller request" in _message(displaced) and "(n)" in _message(displaced)
    _until(lambda: _pending(url) == 0, "the displaced chat is still held")


def test_health_generate_fits_its_probe_into_a_running_batch(url):
    """Continuous batching: a busy engine still generates the probe's token, so it is healthy (as SGLang's
    own `/health_generate` answers while the server makes progress)."""
    worker = threading.Thread(target=post, args=(f"{url}/generate",), kwargs={"json": LONG, "timeout": 60})
    worker.start()
    _until(lambda: _pending(url) == 1, "the long request did not arrive")
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
    assert _pending(url) == 1  # the long request runs on
    worker.join(60)


def test_health_generate_says_503_within_its_timeout_when_no_token_comes():
    """Static batching: the probe waits for the running batch, so past `health_timeout_s` the engine is not
    healthy, and `/health` still says it is alive."""
    with serving(_slowed(load_model("tiny")), limits=LIMITS, batching="static") as (url, _):
        worker = threading.Thread(target=post, args=(f"{url}/generate",), kwargs={"json": LONG, "timeout": 60})
        worker.start()
        _until(lambda: _pending(url) == 1, "the long request did not arrive")
        health = httpx.get(f"{url}/health_generate", timeout=30)
        assert health.status_code == 503 and "health_timeout_s" in health.text
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # alive, only busy
        worker.join(60)


# --- slow clients -------------------------------------------------------------------------------


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed the connection (reads EOF, possibly after an error response)."""
    sock.settimeout(30)
    try:
        while chunk := sock.recv(4096):
            del chunk
    except (ConnectionResetError, TimeoutError):
        return False
    return True


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connects and says nothing
        b"POST /generate HTTP/1.1\r\nHost: x\r\n",  # half a header
        b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key\r\nContent-Length: 100\r\n\r\n{\"in",
    ],
    ids=["silent", "partial-header", "stalled-body"],
)
def test_a_stalled_client_is_disconnected(url, sent):
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(sent)
        assert _closed_by_server(sock)


def test_many_stalled_clients_are_all_dropped_and_the_server_still_answers(url):
    host, port = url.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port))) for _ in range(100)]
    try:
        for sock in socks:
            sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert all(_closed_by_server(sock) for sock in socks)
    finally:
        for sock in socks:
            sock.close()
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


# --- `relax-gym serve` as a process: the key, memory under oversized input, SIGTERM ---------------


def _cli_serve(port: int, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    environment = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    return subprocess.Popen([sys.executable, "-m", "relax_gym.cli", "serve", "--model", "tiny", "--port", str(port),
                             *args], env={**environment, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_up(process: subprocess.Popen, url: str) -> None:
    def up() -> bool:
        assert process.poll() is None, process.stdout.read()
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    _until(up, "relax-gym serve did not come up", 120)


def _status(pid: int, field: str) -> int:
    """A /proc/PID/status memory field in KiB (VmRSS now, VmHWM the peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def test_beyond_loopback_without_a_key_the_server_refuses_to_start():
    process = _cli_serve(free_port(), "--host", "0.0.0.0")
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 2, out
    assert "needs an API key" in out and API_KEY_ENV in out and "Traceback" not in out


@pytest.mark.timeout(300)
def test_serve_prints_a_generated_key_bounds_memory_under_oversized_input_and_stops_on_sigterm():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = _cli_serve(port, "--drain-timeout-s", "2")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        _wait_up(process, url)
        _until(lambda: any("API key (generated" in line for line in lines), "no generated key was printed")
        key = next(line for line in lines if "API key (generated" in line).split()[-1]
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.post(f"{url}/generate", json=SHORT, timeout=30, headers=auth).status_code == 200
        assert httpx.post(f"{url}/generate", json=SHORT, timeout=30).status_code == 401

        peak_before = _status(process.pid, "VmHWM")
        huge = b'{"input_ids": [' + b"123456," * ((50 << 20) // 7) + b"1]}"  # 50 MB of input_ids
        answer = httpx.post(f"{url}/generate", content=huge, timeout=60,
                            headers={**auth, "Content-Type": "application/json"})
        assert answer.status_code == 413
        bombs = {**SHORT, "image_data": [_data_url(_png(12_000, 12_000))] * 4}

        def bomb() -> int:
            return httpx.post(f"{url}/generate", json=bombs, timeout=60, headers=auth).status_code

        codes: list[int] = []
        threads = [threading.Thread(target=lambda: codes.append(bomb())) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert codes == [400] * 8
        text = httpx.post(f"{url}/generate", json={"text": "hello " * 700_000}, timeout=60, headers=auth)  # 4 MB
        assert text.status_code == 400 and "characters cannot fit" in text.json()["error"]["message"]  # untokenized
        grown_mib = (_status(process.pid, "VmHWM") - peak_before) / 1024
        assert grown_mib < 200, f"the server's peak memory grew by {grown_mib:.0f} MiB"

        # SIGTERM with a request in flight that would run for minutes: drained, then stopped.
        long = threading.Thread(target=lambda: _swallow(lambda: httpx.post(
            f"{url}/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 4000}}, timeout=120,
            headers=auth)), daemon=True)
        long.start()
        time.sleep(0.5)  # let it start generating (the stop is bounded either way)
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)  # raises if the server outlives its drain by far
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    assert code == -signal.SIGTERM  # uvicorn re-raises the signal once it has drained and stopped


def _swallow(call) -> None:
    with contextlib.suppress(httpx.HTTPError):
        call()
