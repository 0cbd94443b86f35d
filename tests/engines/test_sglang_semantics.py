"""SGLang's semantics, met by the SGLang client and by `relax-gym serve`: an abort-mode pause before a weight
update (the server answers running and queued requests as SGLang does, refuses to flush while requests run, and
the client sends an aborted request on after the update, each token keeping the version that generated it),
per-token versions from SGLang's spans, and seeds as SGLang takes them."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save
from support.engines import AUTH, KEY, chaotic_model, make_request, serving, teacher_forced

from relax_gym import messages as M
from relax_gym.engines import EngineError, RequestError, SamplingParams, SGLangEngine, tensor_ipc
from relax_gym.engines.embedded import EmbeddedEngine
from relax_gym.engines.sglang import PAUSE_ABORTED, PAUSE_ABORTED_QUEUED
from relax_gym.models import LoadedModel, load_model, processor_inputs
from relax_gym.models.inputs import at_model_rate
from relax_gym.rollout.tokens import ConversationTokens

STEP_S = 0.004  # each forward of the served model sleeps this long, so a long request is still running when paused
LONG = 300  # tokens: about 1.2 s at STEP_S
NORM_ONES = base64.b64encode(save({"model.norm.weight": torch.ones(64)})).decode()


def slowed(loaded: LoadedModel) -> LoadedModel:
    loaded.model.register_forward_pre_hook(lambda *_: time.sleep(STEP_S))
    return loaded


@pytest.fixture(scope="module")
def prompt_model() -> LoadedModel:
    return chaotic_model("tiny")


@pytest.fixture
def one_row() -> Iterator[tuple[str, EmbeddedEngine]]:
    """A slowed server that runs one request at a time, so a second one waits in its queue."""
    with serving(slowed(chaotic_model("tiny")), max_batch_size=1) as served:
        yield served


async def _until_busy(engine: EmbeddedEngine) -> None:
    for _ in range(500):
        if engine.busy:
            await asyncio.sleep(0.1)  # a few tokens in
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the server never started the request")


def _body(prompt: list[int], max_new_tokens: int) -> dict:
    return {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}


@pytest.mark.timeout(60)
def test_an_abort_mode_pause_answers_running_and_queued_requests_as_sglang_does(one_row, prompt_model):
    url, engine = one_row
    prompt = make_request(prompt_model, [M.user("Count")], SamplingParams()).input_ids

    async def run():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as http:
            running = asyncio.create_task(http.post("/generate", json=_body(prompt, LONG)))
            await _until_busy(engine)
            queued = asyncio.create_task(http.post("/generate", json=_body(prompt, 4)))
            await asyncio.sleep(0.05)
            flush_busy = await http.post("/flush_cache")
            update_busy = await http.post("/update_weights_from_tensor", json={"safetensors_b64": NORM_ONES})
            paused = await http.post("/pause_generation", json={})  # SGLang's default mode: abort
            answers = [(await task).json() for task in (running, queued)]
            flush_idle = await http.post("/flush_cache")
            waiting = asyncio.create_task(http.post("/generate", json=_body(prompt, 4)))
            await asyncio.sleep(0.3)
            waited = not waiting.done()
            await http.post("/continue_generation", json={})
            return flush_busy, update_busy, paused, answers, flush_idle, waited, (await waiting).json()

    flush_busy, update_busy, paused, (running, queued), flush_idle, waited, after = asyncio.run(run())
    assert flush_busy.status_code == 400
    assert update_busy.status_code == 400 and "flush_cache" in update_busy.json()["message"]
    assert paused.status_code == 200 and paused.json()["status"] == "ok"
    assert running["meta_info"]["finish_reason"] == {"type": "abort", "message": PAUSE_ABORTED, "status_code": None,
                                                     "err_type": None}
    assert 0 < len(running["output_ids"]) < LONG
    assert len(running["meta_info"]["output_token_logprobs"]) == len(running["output_ids"])
    assert queued["meta_info"]["finish_reason"]["message"] == PAUSE_ABORTED_QUEUED and queued["output_ids"] == []
    assert flush_idle.status_code == 200
    assert waited and after["meta_info"]["finish_reason"]["type"] == "length" and len(after["output_ids"]) == 4


@pytest.mark.timeout(60)
def test_the_client_sends_a_paused_request_on_and_keeps_each_tokens_version(prompt_model):
    """Paused mid-request, updated, resumed: the client's one answer goes on where the pause cut it, the tokens
    before the pause from version 0 and after it from version 5, each with the logprob its own weights give it."""
    sampling = SamplingParams(temperature=0.8, max_new_tokens=LONG, seed=3)
    request = make_request(prompt_model, [M.user("Count")], sampling)
    request.rid = "episode-7"  # the part sent after the pause goes as "episode-7-resume1"
    updated = chaotic_model("tiny")
    with torch.no_grad():
        updated.model.model.norm.weight.fill_(2.0)

    with serving(slowed(chaotic_model("tiny"))) as (url, engine):

        async def run():
            client = SGLangEngine(url, timeout_s=30.0, api_key=KEY)
            try:
                task = asyncio.create_task(client.generate(request))
                await _until_busy(engine)
                await client.pause()
                await client.update_weights({"model.norm.weight": updated.model.model.norm.weight}, 5)
                await asyncio.sleep(0.2)
                held = not task.done()
                await client.resume()
                return held, await task
            finally:
                await client.close()

        held, out = asyncio.run(run())
    assert held  # still waiting after the update: it was aborted mid-way and sent on
    n = len(out.output_ids)  # the whole budget, unless the sampled continuation hit an end of turn
    assert out.finish_reason == ("length" if n == LONG else "stop") and out.weight_version == 5
    versions = out.versions()
    split = versions.index(5)
    assert 0 < split < n and versions == [0] * split + [5] * (n - split)
    logprobs = torch.tensor(out.logprobs)
    assert torch.allclose(logprobs[:split], teacher_forced(prompt_model, request, out.output_ids)[:split], atol=1e-4)
    assert torch.allclose(logprobs[split:], teacher_forced(updated, request, out.output_ids)[split:], atol=1e-4)


def test_per_token_versions_come_from_sglangs_weight_version_spans():
    """SGLang 0.5.21+ reports `weight_versions` spans ([start, end) over the output); a single span, or none
    (older servers), leaves every token at `weight_version`."""
    client = SGLangEngine("http://127.0.0.1:9")

    def answer(spans: list[dict] | None, n: int = 5) -> dict:
        meta = {"finish_reason": {"type": "length", "length": n}, "prompt_tokens": 3, "weight_version": "8",
                "output_token_logprobs": [[-0.5, t, None] for t in range(n)]}
        return {"output_ids": list(range(n)), "meta_info": meta | ({"weight_versions": spans} if spans else {})}

    split = client._output(answer([{"version": "7", "start": 0, "end": 2}, {"version": "8", "start": 2, "end": 5}]), 3)
    assert split.versions() == [7, 7, 8, 8, 8] and split.weight_version == 8
    single = client._output(answer([{"version": "8", "start": 0, "end": 5}]), 3)
    assert single.token_versions is None and single.versions() == [8] * 5
    assert client._output(answer(None), 3).versions() == [8] * 5
    first = client._output(answer([{"version": "default", "start": 0, "end": 1},
                                   {"version": "9", "start": 1, "end": 5}]), 3)
    assert first.versions() == [8, 9, 9, 9, 9]  # SGLang's initial version is "default": the one the client knew
    asyncio.run(client.close())


def test_a_prompt_sglang_tokenized_again_fails_the_request_instead_of_training_on_other_tokens():
    """SGLang decodes the ids of a prompt with media and runs its processor on the text; when the prompt it ran is
    not the one sent, its tokens and logprobs belong to another prompt, so the client refuses them."""
    client = SGLangEngine("http://127.0.0.1:9")

    def answer(prompt_tokens: int, n: int, reason: str = "length") -> dict:
        meta = {"finish_reason": {"type": reason}, "prompt_tokens": prompt_tokens, "weight_version": "1",
                "output_token_logprobs": [[-0.5, t, None] for t in range(n)]}
        return {"output_ids": list(range(n)), "meta_info": meta}

    assert client._output(answer(40, 3), 40).prompt_tokens == 40
    with pytest.raises(EngineError, match=r"ran a prompt of 38 tokens for the 40 sent: it tokenized the prompt again"):
        client._output(answer(38, 3), 40)
    assert client._output(answer(0, 0, "abort"), 40).output_ids == []  # aborted in the queue: nothing ran
    asyncio.run(client.close())


def test_audio_goes_to_engines_at_the_models_rate_so_a_server_resamples_nothing():
    """SGLang resamples a clip at another rate with its own filter; at the model's rate the samples it decodes
    are the ones the trainer's features come from, and those features are unchanged."""
    loaded = load_model("tiny-audio")
    wave = np.random.default_rng(1).standard_normal(6_000).astype(np.float32) * 0.1
    rate = loaded.processor.feature_extractor.sampling_rate
    [(resampled, got_rate)] = at_model_rate(loaded, [(wave, 8_000)])
    assert got_rate == rate and len(resampled) == 6_000 * rate // 8_000
    convo = [M.user("Listen", M.audio(wave, 8_000))]
    again = [M.user("Listen", M.audio(resampled, rate))]
    original, served = processor_inputs(loaded, convo), processor_inputs(loaded, again)
    assert all(torch.equal(original[k], served[k]) for k in original)
    assert at_model_rate(loaded, [(resampled, rate)])[0][0] is resampled  # at the rate already: left as it is
    conv = ConversationTokens.start(loaded, convo)  # what the rollout manager's requests carry
    assert conv.media[0][1] == 8_000  # the trajectory keeps the clip as the env gave it
    [(sent, sent_rate)] = conv.request_audios
    assert sent_rate == rate and np.array_equal(sent, resampled)


def test_seeds_go_to_sglang_in_31_bits():
    """A seed beyond 31 bits would overflow SGLang 0.5.6's int32 sampling seed: the low 31 bits are sent."""
    assert SamplingParams(seed=2**55 + 2**31 + 5).to_sglang()["sampling_seed"] == 5
    assert SamplingParams(seed=7).to_sglang()["sampling_seed"] == 7
    assert "sampling_seed" not in SamplingParams().to_sglang()


class RecordedSGLang:
    """SGLang's answers, as its routes give them (0.5.2x), over an httpx transport: a stand-in for the server where
    only the request and response shapes matter. `busy_flushes` is how many /flush_cache calls find requests still
    running (400), as after an abort-mode pause. Every request's route and JSON body is kept in `sent`."""

    def __init__(self, deterministic: bool | None = False, busy_flushes: int = 0):
        self.info = {"model_path": "Qwen/Qwen3-0.6B", "tp_size": 1, "weight_version": "default", "version": "0.5.23"}
        if deterministic is not None:
            self.info["enable_deterministic_inference"] = deterministic
        self.busy_flushes = busy_flushes
        self.sent: list[tuple[str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.sent.append((request.url.path, body))
        match request.url.path:
            case "/flush_cache" if self.busy_flushes:
                self.busy_flushes -= 1
                return httpx.Response(400, text="Cache not flushed. Please check backend logs for more details. (When "
                                                "there are running or waiting requests, the operation will not be "
                                                "performed.)\n")
            case "/flush_cache":
                return httpx.Response(200, text="Cache flushed.\nPlease check backend logs for more details. (When "
                                                "there are running or waiting requests, the operation will not be "
                                                "performed.)\n")
            case "/update_weights_from_tensor":  # SGLang: each TP rank unpickles its entry and loads the tensors
                self.received = [tensor_ipc.load(entry) for entry in body["serialized_named_tensors"]]
                return httpx.Response(200, json={"success": True, "message": "Success"})
            case "/update_weights_from_disk":
                return httpx.Response(200, json={"success": True, "message": "Succeeded to update model weights.",
                                                 "num_paused_requests": 0})
            case "/health":
                return httpx.Response(200)
        answers = {"/continue_generation": {"status": "ok", "message": "Generation continued."},
                   "/pause_generation": {"status": "ok", "message": "Generation paused successfully."},
                   "/get_server_info": self.info,
                   "/get_model_info": {"model_path": "Qwen/Qwen3-0.6B", "is_generation": True}}
        return httpx.Response(200, json=answers[request.url.path])

    def client(self, **kwargs) -> SGLangEngine:
        client = SGLangEngine("http://127.0.0.1:9", backoff_s=0.01, **kwargs)
        client._client = httpx.AsyncClient(base_url=client.base_url, transport=httpx.MockTransport(self))
        return client


def test_a_weight_update_pauses_in_abort_mode_waits_for_the_flush_and_updates_without_one():
    """slime's order against SGLang: pause in abort mode, retry /flush_cache until the aborted requests are gone,
    then update with `flush_cache: false` (a flush that fails after an update asserts in SGLang < 0.5.23)."""
    sglang = RecordedSGLang(busy_flushes=2)

    async def push(client: SGLangEngine) -> None:
        await client.pause()
        await client.update_weights("/weights/v3", 3)
        await client.resume()

    asyncio.run(_using(sglang.client(), push))
    assert sglang.sent == [
        ("/pause_generation", {"mode": "abort"}), *[("/flush_cache", None)] * 3,
        ("/update_weights_from_disk", {"model_path": "/weights/v3", "weight_version": "3", "flush_cache": False}),
        ("/continue_generation", {}),
    ]


def test_a_state_dict_goes_to_sglang_as_its_serialized_named_tensors_one_per_tp_rank():
    """On this host the client sends SGLang's own payload, which each rank of a tp_size-2 server unpickles; a
    server elsewhere cannot map this process's memory, and SGLang reads nothing else, so the client refuses."""
    sglang = RecordedSGLang()
    sglang.info["tp_size"] = 2
    weights = {"lm_head.weight": torch.randn(4, 3), "model.norm.weight": torch.ones(3, dtype=torch.bfloat16)}

    async def push(client: SGLangEngine) -> None:
        await client.update_weights(weights, 4)

    asyncio.run(_using(sglang.client(), push))
    route, body = sglang.sent[-1]
    assert route == "/update_weights_from_tensor" and len(body["serialized_named_tensors"]) == 2
    assert {k: v for k, v in body.items() if k != "serialized_named_tensors"} == {"weight_version": "4",
                                                                                  "flush_cache": False}
    for rank in sglang.received:
        assert rank.keys() == weights.keys() and all(torch.equal(rank[k], weights[k]) for k in weights)

    async def refused(client: SGLangEngine) -> None:
        with pytest.raises(RequestError, match=r"is SGLang.*share_tensors is off.*weight_sync: disk"):
            await client.update_weights(weights, 5)

    remote = RecordedSGLang()
    asyncio.run(_using(remote.client(share_tensors=False), refused))
    assert [route for route, _ in remote.sent] == ["/get_server_info"]  # the state dict was never sent


async def _using(client: SGLangEngine, use) -> None:
    try:
        await use(client)
    finally:
        await client.close()


def test_connecting_to_an_sglang_that_ignores_seeds_says_so_once(caplog):
    """SGLang's /get_server_info lists its launch arguments; without deterministic inference `sampling_seed` is
    ignored, which the client says when it connects (a server without the field, like relax-gym serve, is quiet)."""
    warnings = []
    for deterministic in (False, True, None):
        caplog.clear()
        with caplog.at_level("WARNING", logger="relax_gym.engines"):
            asyncio.run(_using(RecordedSGLang(deterministic).client(), SGLangEngine.connect))
        warnings.append([r.getMessage() for r in caplog.records])
    assert len(warnings[0]) == 1 and "--enable-deterministic-inference" in warnings[0][0]
    assert warnings[1:] == [[], []]
