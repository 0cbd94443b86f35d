"""The SGLang client against `relax-gym serve` over real HTTP on loopback: the same tokens and
logprobs as the in-process engine, media as PNG / WAV, weight updates, pause, errors, outages."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext

import httpx
import numpy as np
import pytest
import soundfile
import torch
from PIL import Image
from support.engines import (
    AUTH,
    KEY,
    chaotic_model,
    free_port,
    get,
    make_request,
    post,
    serving,
    teacher_forced,
    weight_session,
)

from relax_gym import messages as M
from relax_gym.engines import (
    EmbeddedEngine,
    EngineError,
    GenerateRequest,
    RequestError,
    SamplingParams,
    SGLangEngine,
    launch_sglang_server,
)
from relax_gym.engines.base import API_KEY_ENV, EngineUnavailableError
from relax_gym.engines.embedded import MAX_BATCH_SIZE
from relax_gym.engines.sglang import png_data_url, wav_data_url
from relax_gym.models import LoadedModel, load_model, save_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
@pytest.fixture(scope="module")
def served() -> Iterator[dict[str, tuple[str, EmbeddedEngine]]]:
    """One server per tiny model (chaotic weights), for the tests that do not change weights."""
    with (
        serving(chaotic_model("tiny")) as text,
        serving(chaotic_model("tiny-vl")) as vl,
        serving(chaotic_model("tiny-audio")) as audio,
    ):
        yield {"tiny": text, "tiny-vl": vl, "tiny-audio": audio}


@pytest.fixture(scope="module")
def servers(served) -> dict[str, str]:
    return {name: url for name, (url, _) in served.items()}


@pytest.fixture(scope="module")
def references() -> dict[str, LoadedModel]:
    """The same weights as the servers', in this process."""
    return {name: chaotic_model(name) for name in ("tiny", "tiny-vl", "tiny-audio")}


def _media_conversation(name: str) -> list[M.Message]:
    rng = np.random.default_rng(0)
    if name == "tiny-vl":
        first = Image.fromarray(rng.integers(0, 255, (48, 80, 3), dtype=np.uint8))
        second = Image.fromarray(rng.integers(0, 255, (64, 32, 3), dtype=np.uint8))
        return [M.user("Compare", M.image(first), "with", M.image(second))]
    if name == "tiny-audio":
        return [M.user("Listen", M.audio(rng.standard_normal(12_000).astype(np.float32) * 0.1, 16_000))]
    if name == "tiny-vl-video":  # a clip and an image: video_data and image_data in one request
        frames = [Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)) for _ in range(5)]
        picture = Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8))
        return [M.user("What moves?", M.video(frames, fps=2.5), "and here?", M.image(picture))]
    return [M.user("What is 6*7?")]


async def _with_client(url: str, use, **kwargs):
    client = SGLangEngine(url, **{"timeout_s": 30.0, "api_key": KEY, **kwargs})
    try:
        return await use(client)
    finally:
        await client.close()


def _in_process(loaded: LoadedModel, request: GenerateRequest):
    async def run():
        engine = EmbeddedEngine(loaded)
        try:
            return await engine.generate(request)
        finally:
            await engine.close()

    return asyncio.run(run())


# --- generation ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["tiny", "tiny-vl", "tiny-audio", "tiny-vl-video"])
def test_client_matches_the_in_process_engine(servers, references, name):
    """Greedy tokens and logprobs over HTTP (media as PNG / WAV / lossless video, features recomputed
    server-side) equal the in-process engine's; sampled logprobs equal the teacher-forced forward."""
    loaded = references[name.removesuffix("-video")]
    greedy = make_request(loaded, _media_conversation(name), GREEDY)
    sampled = make_request(loaded, _media_conversation(name), SamplingParams(temperature=0.8, top_p=0.95))
    local = _in_process(loaded, greedy)

    async def use(client: SGLangEngine):
        return await asyncio.gather(client.generate(greedy), client.generate(sampled))

    remote, remote_sampled = asyncio.run(_with_client(servers[name.removesuffix("-video")], use))
    assert remote.output_ids == local.output_ids and len(set(remote.output_ids)) > 3
    assert remote.logprobs == pytest.approx(local.logprobs, abs=1e-5)
    assert (remote.finish_reason, remote.weight_version, remote.prompt_tokens) == ("length", 0, len(greedy.input_ids))
    diff = (teacher_forced(loaded, sampled, remote_sampled.output_ids) - torch.tensor(remote_sampled.logprobs)).abs()
    assert diff.max() <= 1e-4


@pytest.mark.timeout(60)
def test_generate_answers_sglangs_schema(servers, references, tmp_path):
    loaded = references["tiny"]
    request = make_request(loaded, [M.user("What is 6*7?")], GREEDY)
    local = _in_process(loaded, request)
    stop = loaded.tokenizer.decode(local.output_ids[5:6])
    body = {
        "input_ids": request.input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 12, "stop": stop, "n": 1},
        "return_logprob": True,
        "rid": "req-1",
    }
    answer = post(f"{servers['tiny']}/generate", json=body, timeout=30).json()
    ids = answer["output_ids"]
    first = next(k for k in range(len(local.output_ids)) if stop in loaded.tokenizer.decode(local.output_ids[: k + 1]))
    assert ids == local.output_ids[: first + 1]
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": stop}
    assert meta["id"] == "req-1" and meta["weight_version"] == "0"
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(request.input_ids), len(ids))
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(local.logprobs[: len(ids)], abs=1e-5)
    assert stop not in answer["text"]  # SGLang trims the matched stop string from the text

    # `text` prompts are tokenized server-side; the length finish reason says how long.
    by_text = {
        "text": "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n",
        "sampling_params": {"temperature": 0, "max_new_tokens": 12},
    }
    answer = post(f"{servers['tiny']}/generate", json=by_text, timeout=30).json()
    assert answer["output_ids"] == local.output_ids
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert "output_token_logprobs" not in answer["meta_info"]


@pytest.mark.timeout(60)
def test_media_as_data_urls_bare_base64_and_text_prompts(servers, references):
    loaded = references["tiny-vl"]
    request = make_request(loaded, _media_conversation("tiny-vl"), GREEDY)
    local = _in_process(loaded, request)
    first, second = request.images
    bare = png_data_url(second).partition(",")[2]
    body = {
        "input_ids": request.input_ids,
        "image_data": [png_data_url(first), bare],
        "sampling_params": {"temperature": 0, "max_new_tokens": 12},
    }
    assert post(f"{servers['tiny-vl']}/generate", json=body, timeout=30).json()["output_ids"] == local.output_ids
    # A text prompt with one placeholder per image is expanded by the server's processor.
    text = (
        "<|im_start|>user\nCompare<|vision_start|><|image_pad|><|vision_end|>with"
        "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    )
    body = {**body, "text": text}
    del body["input_ids"]
    answer = post(f"{servers['tiny-vl']}/generate", json=body, timeout=30).json()
    assert answer["output_ids"] == local.output_ids and answer["meta_info"]["prompt_tokens"] == len(request.input_ids)

    audio = references["tiny-audio"]
    clip = make_request(audio, _media_conversation("tiny-audio"), GREEDY)
    body = {
        "input_ids": clip.input_ids,
        "audio_data": wav_data_url(*clip.audios[0]),
        "sampling_params": {"temperature": 0, "max_new_tokens": 12},
    }
    answer = post(f"{servers['tiny-audio']}/generate", json=body, timeout=30).json()
    assert answer["output_ids"] == _in_process(audio, clip).output_ids


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/generate", {"sampling_params": {}}, "give exactly one of text or input_ids"),
        ("/generate", {"input_ids": [1], "text": "x"}, "give exactly one of text or input_ids"),
        ("/generate", {"input_ids": [[1, 2], [3]]}, "input_ids.0"),
        ("/generate", {"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ("/generate", {"input_ids": [1], "sampling_params": {"frobnicate": 1}}, "'frobnicate'"),
        ("/generate", {"input_ids": [1], "sampling_params": {"n": 2}}, "n=2 is not supported"),
        ("/generate", {"input_ids": [1], "stream": True}, "stream"),
        ("/generate", {"input_ids": [1, 10**7]}, "input_ids: [10000000] outside the vocabulary"),
        ("/generate", {"input_ids": [1], "image_data": ["data:image/png;base64,!!!"]}, "image_data[0]"),
        ("/generate", {"input_ids": [1], "image_data": [base64.b64encode(b"nope").decode()]}, "image_data[0]"),
        ("/generate", {"input_ids": [1], "image_data": ["https://example.com/a.png"]}, "only inline media"),
        ("/generate", {"input_ids": [1], "audio_data": ["/no/such/file.wav"]}, "audio_data[0]"),
        ("/generate", {"input_ids": [1], "image_data": ["/etc/hostname"]}, "server paths are not read"),
        ("/generate", {"input_ids": [1], "video_data": ["data:video/x-matroska;base64,AAAA"]}, "video_data[0]"),
        ("/update_weights_from_disk", {}, "model_path: Field required"),
        ("/update_weights_from_disk", {"model_path": "/tmp", "weight_version": "v2"}, "weight_version"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}, "serialized_named_tensors: not a pickle"),
        ("/update_weights_from_tensor", {}, "exactly one of serialized_named_tensors"),
        ("/update_weights_from_tensor", {"safetensors_b64": "!!"}, "safetensors_b64"),
        ("/pause_generation", {"mode": "retract"}, "mode"),
        ("/pause_generation", {"mode": "hold"}, "mode"),
    ],
)
def test_malformed_requests_get_400_naming_the_field(servers, route, body, field):
    # a medium goes to a model that takes it (a text model refuses every medium before decoding it)
    name = "tiny-audio" if "audio_data" in body else "tiny-vl" if {"image_data", "video_data"} & set(body) else "tiny"
    with weight_session(servers[name]) if route == "/update_weights_from_tensor" else nullcontext():
        response = post(f"{servers[name]}{route}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    message = response.json().get("error", {}).get("message") or response.json().get("message")
    assert field in message, message


@pytest.mark.timeout(60)
def test_client_raises_request_errors_without_retrying(servers, references):
    bad = GenerateRequest([1, 10**7], GREEDY)

    sent: list[str] = []

    async def use(client: SGLangEngine):
        request = client._client.request

        async def counted(method, route, **kwargs):
            sent.append(route)
            return await request(method, route, **kwargs)

        client._client.request = counted
        with pytest.raises(RequestError, match=r"answered 400 to /generate: input_ids"):
            await client.generate(bad)
        with pytest.raises(RequestError, match=r"answered 400 to /update_weights_from_distributed: names"):
            await client._request("POST", "/update_weights_from_distributed", {})

    asyncio.run(_with_client(servers["tiny"], use, retries=3, backoff_s=2.0))
    assert sent == ["/generate", "/update_weights_from_distributed"]  # each sent once: no retry


# --- weights, pause, health ------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_weight_updates_from_disk_and_tensors(tmp_path):
    trained = chaotic_model("tiny")
    with torch.no_grad():
        for param in trained.model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(2)))
    save_model(trained, tmp_path / "step-7")
    request = make_request(trained, [M.user("What is 6*7?")], SamplingParams(temperature=0, max_new_tokens=16))
    expected = _in_process(trained, request)

    with serving(chaotic_model("tiny")) as (url, engine):

        async def use(client: SGLangEngine):
            before = await client.generate(request)
            await client.update_weights(tmp_path / "step-7", 7)
            after_disk = await client.generate(request)
            await client.update_weights({"model.norm.weight": torch.ones(64)}, 8)
            after_tensor = await client.generate(request)
            with pytest.raises(RequestError, match=r"'model\.nope' is not a parameter"):
                await client.update_weights({"model.nope": torch.ones(2)}, 9)
            return before, after_disk, after_tensor, client.weight_version, await client.model_info()

        before, after_disk, after_tensor, version, info = asyncio.run(_with_client(url, use))
        assert before.weight_version == 0 and before.output_ids != expected.output_ids
        assert after_disk.weight_version == 7 and after_disk.output_ids == expected.output_ids
        assert after_tensor.weight_version == 8 and version == 8 and engine.weight_version == 8
        assert torch.equal(engine.model.model.norm.weight, torch.ones(64))
        assert info["weight_version"] == "8" and info["model_path"] == "tiny" and info["is_generation"]

        async def inline(client: SGLangEngine):  # as to a server on another host: base64 safetensors in the body
            await client.update_weights({"model.norm.weight": torch.full((64,), 2.0)}, 9)

        asyncio.run(_with_client(url, inline, share_tensors=False))
        assert engine.weight_version == 9 and torch.equal(engine.model.model.norm.weight, torch.full((64,), 2.0))


@pytest.mark.timeout(60)
def test_pause_continue_health_and_info(servers):
    url = servers["tiny"]

    async def use(client: SGLangEngine):
        assert await client.health()
        await client.pause()
        held = asyncio.create_task(client.generate(GenerateRequest([5, 6], GREEDY)))
        await asyncio.sleep(0.3)
        assert not held.done()
        async with httpx.AsyncClient(base_url=url, headers=AUTH) as raw:
            assert (await raw.get("/health_generate")).status_code == 503
            assert (await raw.get("/get_server_info")).json()["paused"] is True
        await client.resume()
        out = await asyncio.wait_for(held, 10)
        await client.flush_cache()
        return out

    assert len(asyncio.run(_with_client(url, use)).output_ids) == GREEDY.max_new_tokens
    assert get(f"{url}/health_generate", timeout=30).status_code == 200
    info = get(f"{url}/get_server_info", timeout=30).json()
    assert info["backend"].startswith("relax_gym embedded") and info["max_batch_size"] == MAX_BATCH_SIZE
    assert get(f"{servers['tiny-vl']}/get_model_info", timeout=30).json()["has_image_understanding"]


# --- `serve` itself, then a stopped server -----------------------------------------------------


@pytest.mark.timeout(120)
def test_serve_in_a_subprocess_then_a_stopped_server_raises(tmp_path, references):
    """`serve` on a saved checkpoint folder answers like the in-process engine, takes a state dict shared from
    this process (SGLang's serialized_named_tensors over shared memory); once it is stopped the client raises an
    EngineError naming the URL, within its retry budget."""
    save_model(references["tiny"], tmp_path / "model")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    code = f"from relax_gym.engines import serve; serve({str(tmp_path / 'model')!r}, port={port})"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, API_KEY_ENV: KEY})
    request = make_request(references["tiny"], [M.user("Hello")], GREEDY)
    try:

        async def ready_then_generate(client: SGLangEngine):
            deadline = time.monotonic() + 90
            while not await client.health():
                assert process.poll() is None, process.stderr.read().decode()
                assert time.monotonic() < deadline, "serve did not come up"
                await asyncio.sleep(0.2)
            served = await client.generate(request)
            await client.update_weights(trained.model.state_dict(), 5)  # shared memory: another process maps it
            return served, await client.generate(request)

        trained = chaotic_model("tiny")
        with torch.no_grad():
            for param in trained.model.parameters():
                param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
        served, updated = asyncio.run(_with_client(url, ready_then_generate))
        assert served.output_ids == _in_process(references["tiny"], request).output_ids
        assert updated.weight_version == 5 and updated.output_ids == _in_process(trained, request).output_ids
    finally:
        process.terminate()
        process.wait(30)

    async def stopped(client: SGLangEngine):
        with pytest.raises(EngineUnavailableError, match=rf"server at {url} failed /generate after 3 attempts .*"
                           r"last error: unreachable"):
            await client.generate(request)
        assert not await client.health()

    asyncio.run(_with_client(url, stopped, timeout_s=5.0, retries=2, backoff_s=0.05))


def test_png_and_wav_round_trip_exactly():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (7, 9, 3), dtype=np.uint8))
    decoded = Image.open(io.BytesIO(base64.b64decode(png_data_url(image).partition(",")[2])))
    assert np.array_equal(np.asarray(decoded), np.asarray(image))
    wave = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    back, rate = soundfile.read(
        io.BytesIO(base64.b64decode(wav_data_url(wave, 8000).partition(",")[2])), dtype="float32"
    )
    assert rate == 8000 and np.array_equal(back, wave)


def test_launcher_says_when_sglang_is_missing():
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here: tests/engines/test_sglang_real.py launches it")
    with pytest.raises(EngineError, match="sglang is not installed"):
        launch_sglang_server("/nowhere", free_port())


# --- outages, the connection pool, a server left paused ------------------------------------------


def _counting(client: SGLangEngine) -> list[str]:
    """The routes `client` sends, one entry per attempt."""
    sent: list[str] = []
    request = client._client.request

    async def counted(method, route, **kwargs):
        sent.append(route)
        return await request(method, route, **kwargs)

    client._client.request = counted
    return sent


async def _until(condition, what: str, bound_s: float = 30.0) -> None:
    """Polls `condition`; the bound only says the test did not hang."""

    async def poll():
        while not condition():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), bound_s)
    except TimeoutError:
        pytest.fail(f"never saw: {what}")


def _outage_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "relax_gym.engines" and r.levelno == logging.WARNING]


@pytest.mark.timeout(60)
def test_an_outage_is_waited_out_until_the_server_comes_back(caplog):
    """The server stops and comes back on the same port: a /generate sent meanwhile retries until it
    answers, with one warning when the outage starts and one when it ends."""
    caplog.set_level(logging.WARNING, logger="relax_gym.engines")
    loaded = load_model("tiny")
    port = free_port()
    request = GenerateRequest([5, 6, 7], GREEDY)

    async def use(client: SGLangEngine):
        first = serving(loaded, port)
        await asyncio.to_thread(first.__enter__)
        before = await client.generate(request)
        await asyncio.to_thread(first.__exit__, None, None, None)
        sent = _counting(client)
        waiting = asyncio.create_task(client.generate(request))
        await _until(lambda: len(sent) >= 4 or waiting.done(), "4 attempts on the stopped server")
        assert not waiting.done(), waiting.exception()
        second = serving(loaded, port)
        await asyncio.to_thread(second.__enter__)
        try:
            after = await asyncio.wait_for(waiting, 30)
        finally:
            await asyncio.to_thread(second.__exit__, None, None, None)
        return before, after, len(sent), client.outages

    before, after, attempts, outages = asyncio.run(
        _with_client(f"http://127.0.0.1:{port}", use, backoff_s=0.02, max_backoff_s=0.1, outage_timeout_s=60)
    )
    assert after.output_ids == before.output_ids and len(after.output_ids) == GREEDY.max_new_tokens
    assert attempts >= 5 and outages == 1
    logs = _outage_logs(caplog)
    assert len(logs) == 2, logs
    assert logs[0].startswith(f"server at http://127.0.0.1:{port} is unreachable (/generate: unreachable")
    assert logs[1].startswith(f"server at http://127.0.0.1:{port} is back after")


@pytest.mark.timeout(60)
def test_an_outage_longer_than_its_budget_raises_unavailable(caplog):
    """Past `outage_timeout_s` the error names the server, the route, the time waited and the last error;
    the retries in between log nothing more."""
    caplog.set_level(logging.WARNING, logger="relax_gym.engines")
    url = f"http://127.0.0.1:{free_port()}"

    async def use(client: SGLangEngine):
        sent = _counting(client)
        with pytest.raises(EngineUnavailableError) as raised:
            await client.pause()
        with pytest.raises(EngineUnavailableError):
            await client.resume()
        return str(raised.value), sent

    message, sent = asyncio.run(
        _with_client(url, use, backoff_s=0.01, max_backoff_s=0.05, outage_timeout_s=0.5)
    )
    attempts = sent.count("/pause_generation")
    assert attempts >= 5 and sent.count("/continue_generation") >= 5
    assert message.startswith(f"server at {url} failed /pause_generation after {attempts} attempts over 0.")
    assert "(outage_timeout_s=0.5); last error: unreachable (ConnectError" in message
    assert len(_outage_logs(caplog)) == 1  # one outage, two calls, many retries: one warning


@pytest.mark.timeout(60)
def test_cancelling_a_call_that_waits_out_an_outage_ends_it():
    """Ctrl-C cancels the main task: the retry loop must not swallow the cancellation."""
    url = f"http://127.0.0.1:{free_port()}"

    async def use(client: SGLangEngine):
        sent = _counting(client)
        waiting = asyncio.create_task(client.generate(GenerateRequest([5, 6], GREEDY)))
        await _until(lambda: len(sent) >= 6 or waiting.done(), "6 attempts on a closed port")
        assert not waiting.done(), waiting.exception()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiting, 5)  # a bound for "it did not hang"
        return waiting.cancelled()

    assert asyncio.run(_with_client(url, use, backoff_s=0.01, max_backoff_s=0.05, outage_timeout_s=600))


def _held_by_a_paused_server(served, n: int, held: int, **client_kwargs) -> tuple[int, list]:
    """`n` concurrent one-token requests to the paused tiny server: how many it holds once `held` have arrived
    (and half a second more, for any others the client's pool lets through), then every output once resumed."""
    url, engine = served["tiny"]
    tiny = SamplingParams(temperature=0, max_new_tokens=1)

    async def use(client: SGLangEngine):
        await client.pause()
        try:
            calls = [asyncio.create_task(client.generate(GenerateRequest([5, i], tiny))) for i in range(n)]
            jobs = engine._queue.jobs
            await _until(lambda: len(jobs) >= held or any(c.done() for c in calls), f"{held} queued requests")
            await asyncio.sleep(0.5)
            queued = len(jobs)
        finally:
            await client.resume()
        return queued, await asyncio.gather(*calls)

    return asyncio.run(_with_client(url, use, **client_kwargs))


@pytest.mark.timeout(60)
def test_the_pool_lets_every_concurrent_request_reach_the_server(served):
    """150 concurrent /generate calls on a paused server are all sent at once (httpx's default pool
    would hold 50 of them back, then abort them once its pool timeout ran out)."""
    queued, outputs = _held_by_a_paused_server(served, 150, 150)
    assert queued == 150 and len(outputs) == 150 and all(len(out.output_ids) == 1 for out in outputs)


@pytest.mark.timeout(60)
def test_a_capped_pool_holds_requests_back_without_timing_them_out(served):
    """`max_connections=8`, split between the client's pools (`ShardedTransport`): a paused server sees at most
    8 requests at once, and the 40 others wait for a connection as long as it takes, then complete."""
    queued, outputs = _held_by_a_paused_server(served, 48, 8, max_connections=8)
    assert queued == 8 and len(outputs) == 48 and all(len(out.output_ids) == 1 for out in outputs)


@pytest.mark.timeout(60)
def test_a_client_that_goes_away_while_its_request_waits_is_dropped_quietly(served, caplog):
    """A request held by a paused server whose client gives up: the server drops it (its task is only asked to
    cancel when the disconnect is seen, so its result must not be read then) and logs no error."""
    url, _ = served["tiny"]

    async def use(client: SGLangEngine):
        await client.pause()
        try:
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=0.5) as impatient:
                with pytest.raises(httpx.ReadTimeout):
                    await impatient.post("/generate", json={"input_ids": [5, 6], "sampling_params": {}})
            await asyncio.sleep(0.3)  # the server notices the disconnect
        finally:
            await client.resume()
        return await client.generate(GenerateRequest([5, 6], GREEDY))

    caplog.set_level(logging.ERROR)
    assert asyncio.run(_with_client(url, use)).output_ids
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]


@pytest.mark.timeout(60)
def test_connect_resumes_a_server_left_paused(servers):
    """A trainer killed between pause() and resume() leaves the server paused; the next run's
    connect() makes it serve again and returns the model info."""
    url = servers["tiny"]

    def paused() -> bool:
        return get(f"{url}/get_server_info", timeout=30).json()["paused"]

    async def killed_trainer(client: SGLangEngine):
        await client.pause()

    async def next_run(client: SGLangEngine):
        info = await client.connect()
        return info, paused(), await client.generate(GenerateRequest([5, 6], GREEDY))

    try:
        asyncio.run(_with_client(url, killed_trainer))
        assert paused()
        info, still_paused, out = asyncio.run(_with_client(url, next_run))
    finally:
        post(f"{url}/continue_generation", timeout=30)
    assert info["model_path"] == "tiny" and not still_paused and len(out.output_ids) == GREEDY.max_new_tokens
