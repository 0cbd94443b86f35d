"""The embedded engine on the three tiny models: logprobs a trainer can reproduce, real batching,
per-row sampling params, in-place weight updates, pause / resume, close."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from PIL import Image
from support.engines import make_request, teacher_forced

from relax_gym import messages as M
from relax_gym.engines import EmbeddedEngine, EngineError, GenerateRequest, RequestError, SamplingParams
from relax_gym.models import LoadedModel, load_model, save_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
PROMPTS = ("What is 6*7?", "Count the red apples in the box, then check the answer.", "Hi")


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))


def _clip(seed: int, samples: int) -> M.AudioPart:
    rng = np.random.default_rng(seed)
    return M.audio(rng.standard_normal(samples).astype(np.float32) * 0.1, 16_000)


def _conversations(name: str) -> list[list[M.Message]]:
    """Rows with different numbers of images / clips (2, 0, 1), so one batch concatenates them."""
    if name == "tiny-vl":
        return [
            [M.user("Compare", M.image(_image(0, (48, 80))), M.image(_image(1, (64, 64))))],
            [M.user("No picture this time, only text.")],
            [M.user(M.image(_image(2, (100, 40))), "What is this?")],
        ]
    if name == "tiny-audio":
        return [
            [M.user("Listen", _clip(0, 12_000), "and", _clip(1, 20_000))],
            [M.user("No sound this time, only text.")],
            [M.user(_clip(2, 8_000), "What is this?")],
        ]
    if name == "tiny-omni":  # every modality, a video in two rows (of different lengths)
        return [
            [M.user(M.image(_image(0, (48, 80))), _clip(0, 12_000), _video(0, 4), "What do you see and hear?")],
            [M.user("No media this time, only text.")],
            [M.user(_video(1, 6), "What moves?", _clip(1, 8_000))],
        ]
    return [[M.user(p)] for p in PROMPTS]


def _video(seed: int, frames: int) -> M.VideoPart:
    return M.video([_image(seed + i, (64, 48)) for i in range(frames)], fps=2.0)


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def tiny() -> dict[str, LoadedModel]:
    return {name: load_model(name) for name in ("tiny", "tiny-moe", "tiny-vl", "tiny-audio", "tiny-omni")}


@pytest.fixture
def text_model() -> LoadedModel:
    """A private copy: tests that change weights must not touch the shared one."""
    return load_model("tiny")


def _perturb(loaded: LoadedModel, scale: float, *, redraw: bool = False) -> LoadedModel:
    """Adds N(0, scale) noise to every parameter (or redraws the matrices from it), in place."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in loaded.model.parameters():
            noise = scale * torch.randn(param.shape, generator=generator)
            if redraw and param.ndim > 1:
                param.copy_(noise)
            else:
                param.add_(noise)
    return loaded


@pytest.fixture(scope="module")
def chaotic() -> LoadedModel:
    """The tiny text model with N(0, 0.3) matrices: its greedy outputs vary from token to token,
    where the stock random init repeats one token."""
    return _perturb(load_model("tiny"), 0.3, redraw=True)


@pytest.fixture
def prefills() -> Iterator[Callable[[torch.nn.Module], list[int]]]:
    """Records the batch size of every prefill forward (one per batch) of a model; the pass over a prefix all of a
    batch's prompts share (`RunningBatch.prefill`, no attention mask) is not a batch."""
    seen: list[int] = []
    handles = []

    def watch(model: torch.nn.Module) -> list[int]:
        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids")
            if ids is not None and ids.shape[1] > 1 and kwargs.get("attention_mask") is not None:
                seen.append(ids.shape[0])

        handles.append(model.register_forward_pre_hook(hook, with_kwargs=True))
        return seen

    yield watch
    for handle in handles:
        handle.remove()


async def _generate_all(engine: EmbeddedEngine, requests: list[GenerateRequest]):
    try:
        return await asyncio.gather(*(engine.generate(r) for r in requests))
    finally:
        await engine.close()


# --- logprobs --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-vl", "tiny-audio", "tiny-omni"])
@pytest.mark.parametrize("with_mm_inputs", [True, False], ids=["mm_inputs", "raw_media"])
def test_logprobs_equal_a_teacher_forced_forward(tiny, prefills, name, with_mm_inputs):
    """Greedy, sampled and top-p/top-k rows with different media counts in one left-padded batch:
    every logprob equals the trainer's unpadded forward of prompt + output (fp32)."""
    loaded = tiny[name]
    samplings = [
        SamplingParams(temperature=0, max_new_tokens=12),
        SamplingParams(temperature=1.0, max_new_tokens=20),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_new_tokens=16),
    ]
    requests = [make_request(loaded, c, s) for c, s in zip(_conversations(name), samplings, strict=True)]
    sent = (
        requests if with_mm_inputs else [GenerateRequest(r.input_ids, r.sampling, r.images, r.audios, videos=r.videos)
                                         for r in requests]
    )
    batches = prefills(loaded.model)
    outputs = _run(_generate_all(EmbeddedEngine(loaded), sent))
    if with_mm_inputs:  # raw media reach the queue only after the processor ran, maybe in another batch
        assert batches == [3]
    worst = 0.0
    for request, out in zip(requests, outputs, strict=True):
        assert out.finish_reason == "length" and len(out.output_ids) == request.sampling.max_new_tokens
        assert out.prompt_tokens == len(request.input_ids) and out.weight_version == 0
        expected = teacher_forced(loaded, request, out.output_ids)
        worst = max(worst, (expected - torch.tensor(out.logprobs)).abs().max().item())
    print(f"{name} ({'mm_inputs' if with_mm_inputs else 'raw media'}): max |logprob diff| = {worst:.2e}")
    assert worst <= 1e-4


# --- batching and per-row params -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_concurrent_requests_are_batched(chaotic, prefills):
    loaded = chaotic
    batches = prefills(loaded.model)
    requests = [make_request(loaded, [M.user(f"Question {i}: what is {i} + {i}?")], GREEDY) for i in range(8)]
    outputs = _run(_generate_all(EmbeddedEngine(loaded, max_batch_size=32), requests))
    assert len(outputs) == 8 and sum(batches) == 8
    assert len(batches) < 8 and max(batches) > 1, batches
    solo = [_run(_generate_all(EmbeddedEngine(loaded), [r]))[0] for r in requests[:3]]
    assert [o.output_ids for o in outputs[:3]] == [o.output_ids for o in solo]


@pytest.mark.timeout(60)
def test_max_batch_size_caps_a_batch(tiny, prefills):
    loaded = tiny["tiny"]
    batches = prefills(loaded.model)
    requests = [make_request(loaded, [M.user(f"Question {i}")], GREEDY) for i in range(7)]
    _run(_generate_all(EmbeddedEngine(loaded, max_batch_size=3), requests))
    assert sum(batches) == 7 and max(batches) <= 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_mixed_sampling_params_in_one_batch(chaotic, prefills, batching):
    """Greedy rows equal their solo runs; each row keeps its own max_new_tokens, stop string and stop id."""
    loaded = chaotic
    tokenizer = loaded.tokenizer
    base = [make_request(loaded, [M.user(p)], SamplingParams(temperature=0, max_new_tokens=24)) for p in PROMPTS]
    solo = [_run(_generate_all(EmbeddedEngine(loaded), [r]))[0] for r in base]
    assert all(s.finish_reason == "length" and len(s.output_ids) == 24 for s in solo)

    # Row 1 stops on a string that first appears with its 6th token; row 2 on its 5th token's id.
    ids1 = solo[1].output_ids
    cut = next(
        k
        for k in range(5, 24)
        if tokenizer.decode(ids1[k : k + 1]).strip()
        and tokenizer.decode(ids1[k : k + 1]) not in tokenizer.decode(ids1[:k])
    )
    stop_text = tokenizer.decode(ids1[cut : cut + 1])
    ids2 = solo[2].output_ids
    stop_id = ids2[4]
    first = ids2.index(stop_id)
    rows = [
        GenerateRequest(base[0].input_ids, SamplingParams(temperature=0, max_new_tokens=7)),
        GenerateRequest(base[1].input_ids, SamplingParams(temperature=0, max_new_tokens=24, stop=(stop_text,))),
        GenerateRequest(base[2].input_ids, SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=(stop_id,))),
        GenerateRequest(base[0].input_ids, SamplingParams(temperature=1.0, max_new_tokens=24)),
        GenerateRequest(base[1].input_ids, SamplingParams(temperature=0.8, top_k=5, max_new_tokens=3)),
        GenerateRequest(base[2].input_ids, SamplingParams(temperature=0, max_new_tokens=24)),
    ]
    batches = prefills(loaded.model)
    out = _run(_generate_all(EmbeddedEngine(loaded, batching=batching), rows))
    # continuous batching prefills the 3 distinct prompts of the 6 rows once each
    assert batches == ([3] if batching == "continuous" else [6])
    assert out[0].output_ids == solo[0].output_ids[:7] and out[0].finish_reason == "length"
    assert out[1].output_ids == ids1[: cut + 1] and out[1].finish_reason == "stop"
    assert out[2].output_ids == ids2[: first + 1] and out[2].finish_reason == "stop"
    assert len(out[3].output_ids) == 24 and out[3].output_ids != solo[0].output_ids
    assert len(out[4].output_ids) == 3 and out[4].finish_reason == "length"
    assert out[5].output_ids == solo[2].output_ids and out[5].logprobs == pytest.approx(solo[2].logprobs, abs=1e-5)


@pytest.mark.timeout(60)
def test_sampled_rows_stop_at_their_stop_strings(chaotic):
    """A row stops exactly when its text first contains one of its stop strings, the token
    that completed it included; rows without stop strings in the same batch run on."""
    loaded = chaotic
    decode = loaded.tokenizer.decode
    stops = ("e", "a", "<think>", "Total")
    rows = [
        GenerateRequest([100 + i, 7, 8], SamplingParams(temperature=1.0, max_new_tokens=40, stop=(stops[i % 4], "o")))
        for i in range(12)
    ]
    rows.append(GenerateRequest([9, 9], SamplingParams(temperature=1.0, max_new_tokens=40)))
    outputs = _run(_generate_all(EmbeddedEngine(loaded), rows))
    for request, out in zip(rows, outputs, strict=True):
        text, before = decode(out.output_ids), decode(out.output_ids[:-1])
        if out.finish_reason == "stop" and request.sampling.stop:
            assert any(s in text for s in request.sampling.stop)
            assert not any(s in before for s in request.sampling.stop)
        elif out.finish_reason == "length":
            assert len(out.output_ids) == 40 and not any(s in text for s in request.sampling.stop)
        else:
            assert out.output_ids[-1] in (loaded.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    assert sum(o.finish_reason == "stop" for o in outputs[:12]) >= 6


@pytest.mark.timeout(60)
def test_sampling_is_seeded(tiny):
    loaded = tiny["tiny"]
    requests = [make_request(loaded, [M.user(p)], SamplingParams(temperature=1.0, max_new_tokens=16)) for p in PROMPTS]
    first = _run(_generate_all(EmbeddedEngine(loaded, seed=7), requests))
    again = _run(_generate_all(EmbeddedEngine(loaded, seed=7), requests))
    other = _run(_generate_all(EmbeddedEngine(loaded, seed=8), requests))
    assert [o.output_ids for o in first] == [o.output_ids for o in again]
    assert [o.output_ids for o in first] != [o.output_ids for o in other]


@pytest.mark.timeout(60)
def test_eos_stops_a_row_and_is_kept(text_model):
    """Doubling <|im_end|>'s (tied) embedding of the greedy first token makes the model emit EOS."""
    eos = text_model.tokenizer.convert_tokens_to_ids("<|im_end|>")
    request = GenerateRequest([5, 6, 7, 8], SamplingParams(temperature=0, max_new_tokens=8))

    async def scenario():
        engine = EmbeddedEngine(text_model)
        try:
            first = (await engine.generate(request)).output_ids[0]
            embeddings = text_model.model.get_input_embeddings().weight.detach().clone()
            embeddings[eos] = 2 * embeddings[first]
            await engine.update_weights({"model.embed_tokens.weight": embeddings}, 1)
            return await engine.generate(request)
        finally:
            await engine.close()

    out = _run(scenario())
    assert out.output_ids == [eos] and out.finish_reason == "stop" and out.weight_version == 1
    assert len(out.logprobs) == 1


@pytest.mark.timeout(60)
def test_a_bad_request_fails_alone(tiny):
    """A VL row whose placeholders do not match its image breaks the batch; the others still finish."""
    loaded = tiny["tiny-vl"]
    good = make_request(loaded, _conversations("tiny-vl")[2], GREEDY)
    ids = list(good.input_ids)
    ids.remove(loaded.model.config.image_token_id)  # one placeholder fewer than the image has features
    bad = GenerateRequest(ids, GREEDY, mm_inputs=good.mm_inputs)

    async def scenario():
        engine = EmbeddedEngine(loaded)
        try:
            return await asyncio.gather(engine.generate(good), engine.generate(bad), return_exceptions=True)
        finally:
            await engine.close()

    ok, failed = _run(scenario())
    assert isinstance(ok.output_ids, list) and len(ok.output_ids) == GREEDY.max_new_tokens
    assert isinstance(failed, EngineError) and "generation failed" in str(failed)


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        (GenerateRequest([], GREEDY), "input_ids: empty"),
        (GenerateRequest([5, 10**6], GREEDY), "outside the vocabulary"),
        (GenerateRequest([5], GREEDY, images=[Image.new("RGB", (8, 8))]), "images given"),
        (GenerateRequest([5], SamplingParams(temperature=-1)), "sampling.temperature"),
        (GenerateRequest([5], SamplingParams(top_p=0)), "sampling.top_p"),
    ],
)
def test_invalid_requests_raise(tiny, request_, match):
    async def scenario():
        engine = EmbeddedEngine(tiny["tiny"])
        try:
            await engine.generate(request_)
        finally:
            await engine.close()

    with pytest.raises(RequestError, match=match):
        _run(scenario())


# --- weights ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_update_weights_from_a_state_dict_in_place(text_model):
    request = make_request(text_model, [M.user(PROMPTS[1])], SamplingParams(temperature=0, max_new_tokens=16))
    params = {name: p.data_ptr() for name, p in text_model.model.named_parameters()}
    reference = _perturb(load_model("tiny"), 0.3, redraw=True)
    new = {name: p.detach().clone() for name, p in reference.model.named_parameters()}

    async def scenario():
        engine = EmbeddedEngine(text_model)
        try:
            before = await engine.generate(request)
            await engine.update_weights(new, 3)
            return before, await engine.generate(request), engine.weight_version
        finally:
            await engine.close()

    before, after, version = _run(scenario())
    assert before.weight_version == 0 and after.weight_version == version == 3
    assert after.output_ids != before.output_ids
    expected = teacher_forced(reference, request, after.output_ids)
    assert (expected - torch.tensor(after.logprobs)).abs().max() <= 1e-4
    assert {name: p.data_ptr() for name, p in text_model.model.named_parameters()} == params  # in place


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["tiny", "tiny-audio"])
def test_update_weights_from_a_saved_folder(tmp_path, name):
    """Qwen2-Audio's checkpoint keys differ from its module names; both load."""
    serving, trained = load_model(name), _perturb(load_model(name), 0.05)
    save_model(trained, tmp_path)
    request = make_request(serving, _conversations(name)[0], GREEDY)

    async def scenario():
        engine = EmbeddedEngine(serving)
        try:
            await engine.update_weights(str(tmp_path), 5)
            return await engine.generate(request)
        finally:
            await engine.close()

    out = _run(scenario())
    assert out.weight_version == 5
    for key, value in trained.model.state_dict().items():
        assert torch.equal(serving.model.state_dict()[key], value), key
    assert (teacher_forced(trained, request, out.output_ids) - torch.tensor(out.logprobs)).abs().max() <= 1e-4


@pytest.mark.timeout(60)
def test_bad_weights_raise_and_change_nothing(text_model, tmp_path):
    before = {k: v.clone() for k, v in text_model.model.state_dict().items()}
    good = text_model.model.state_dict()["model.norm.weight"]

    async def scenario(weights):
        engine = EmbeddedEngine(text_model)
        try:
            await engine.update_weights(weights, 1)
        finally:
            await engine.close()
            assert engine.weight_version == 0

    cases = [
        ({"model.norm.weight": good + 1, "model.not_a_layer.weight": good}, "'model.not_a_layer.weight' is not a"),
        ({"model.norm.weight": torch.zeros(3)}, r"'model.norm.weight' has shape \(3,\), the model's is \(64,\)"),
        ({"model.norm.weight": [1.0]}, "not a tensor"),
        (str(tmp_path / "missing"), "no \\*.safetensors"),
    ]
    for weights, match in cases:
        with pytest.raises(EngineError, match=match):
            _run(scenario(weights))
    assert all(torch.equal(before[k], v) for k, v in text_model.model.state_dict().items())


# --- pause, resume, close --------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_a_caller_holding_its_answer_finds_the_engine_idle(text_model, batching):
    """`busy` (SGLang's running requests, which refuse /flush_cache) counts a request until it is answered, not
    until the worker's loop comes round: a client that flushes on receiving its answer is never refused."""
    engine = EmbeddedEngine(text_model, batching=batching)

    async def each_then_check() -> list[bool]:
        seen = []
        for i in range(20):
            await engine.generate(GenerateRequest([5, 6 + i], SamplingParams(temperature=0, max_new_tokens=2)))
            seen.append(engine.busy)
        return seen

    try:
        assert _run(each_then_check()) == [False] * 20
    finally:
        _run(engine.close())


@pytest.mark.timeout(60)
def test_pause_finishes_the_running_batch_and_holds_new_ones(text_model):
    """The weight-sync sequence: pause (the running batch ends on the old weights), update while
    paused, resume (held requests run on the new ones)."""
    long = GenerateRequest([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=200))
    short = GenerateRequest([8, 9], GREEDY)
    norm = text_model.model.state_dict()["model.norm.weight"]

    async def scenario():
        engine = EmbeddedEngine(text_model)
        try:
            running = asyncio.create_task(engine.generate(long))
            await asyncio.sleep(0.05)
            await engine.pause()
            assert running.done() and len(running.result().output_ids) == 200
            held = asyncio.create_task(engine.generate(short))
            await engine.update_weights({"model.norm.weight": 2 * norm}, 1)
            await asyncio.sleep(0.3)
            assert not held.done() and engine.paused
            await engine.resume()
            return running.result(), await asyncio.wait_for(held, 10)
        finally:
            await engine.close()

    old, new = _run(scenario())
    assert old.weight_version == 0 and new.weight_version == 1
    assert len(new.output_ids) == GREEDY.max_new_tokens


@pytest.mark.timeout(20)
def test_close_aborts_running_and_queued_requests(tiny):
    loaded = tiny["tiny"]
    long = GenerateRequest([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=100_000))  # never hits EOS

    async def scenario():
        engine = EmbeddedEngine(loaded, max_batch_size=1)
        running = asyncio.create_task(engine.generate(long))
        queued = [asyncio.create_task(engine.generate(long)) for _ in range(3)]
        await asyncio.sleep(0.2)
        await engine.close()
        outputs = await asyncio.wait_for(asyncio.gather(running, *queued), 10)
        with pytest.raises(EngineError, match="closed"):
            await engine.generate(long)
        return outputs, await engine.health()

    outputs, healthy = _run(scenario())
    assert all(o.finish_reason == "abort" for o in outputs) and not healthy
    assert 0 < len(outputs[0].output_ids) == len(outputs[0].logprobs) < 100_000
    assert all(o.output_ids == [] for o in outputs[1:])


@pytest.mark.timeout(20)
def test_a_cancelled_request_frees_its_row(tiny):
    loaded = tiny["tiny"]

    async def scenario():
        engine = EmbeddedEngine(loaded)
        try:
            doomed = asyncio.create_task(
                engine.generate(GenerateRequest([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=100_000)))
            )
            await asyncio.sleep(0.2)
            doomed.cancel()
            return await asyncio.wait_for(engine.generate(GenerateRequest([6], GREEDY)), 10)
        finally:
            await engine.close()

    assert len(_run(scenario()).output_ids) == GREEDY.max_new_tokens


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "token"), [("tiny-vl", "<|image_pad|>"), ("tiny-audio", "<|AUDIO|>")])
def test_media_placeholders_are_never_sampled(name, token):
    """A placeholder in an output has no features, so the trainer's forward would fail on the
    trajectory: the engine skips it even where it is the argmax, and the logprobs it reports are
    still the full-vocabulary ones the trainer recomputes."""
    loaded = load_model(name)
    placeholder = loaded.tokenizer.convert_tokens_to_ids(token)
    request = make_request(loaded, [M.user("Describe it.")], GREEDY)
    first = _run(_generate_all(EmbeddedEngine(loaded), [request]))[0].output_ids[0]
    with torch.no_grad():  # make the placeholder the model's favourite next token
        head = loaded.model.get_output_embeddings().weight
        head[placeholder] = 2 * head[first]
    engine = EmbeddedEngine(loaded)
    assert placeholder in engine.placeholder_token_ids
    sampled = GenerateRequest(request.input_ids, SamplingParams(temperature=1.0, max_new_tokens=64))
    greedy, sampled = _run(_generate_all(engine, [request, sampled]))
    for out in (greedy, sampled):
        assert placeholder not in out.output_ids
    assert greedy.output_ids[0] == first
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor([request.input_ids])).logits[0, -1]
    assert logits.argmax() == placeholder
    expected = teacher_forced(loaded, request, greedy.output_ids)
    assert (expected - torch.tensor(greedy.logprobs)).abs().max() <= 1e-4


def test_the_engine_moves_its_model_to_the_device_it_is_given():
    """`rollout.engine_device`: "auto" is the CPU on a machine without a GPU; a device torch lacks is refused."""
    from relax_gym.engines.embedded import engine_device

    loaded = load_model("tiny")
    engine = EmbeddedEngine(loaded, device=engine_device("auto" if not torch.cuda.is_available() else "cpu"))
    try:
        assert engine.device == torch.device("cpu") and next(loaded.model.parameters()).dtype == torch.float32
        assert len(_run(engine.generate(GenerateRequest([5, 6], GREEDY))).output_ids) == GREEDY.max_new_tokens
    finally:
        _run(engine.close())
    with pytest.raises(ValueError, match="not a device"):
        engine_device("tpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_engine_serves_in_bfloat16_and_matches_a_teacher_forced_forward():
    loaded = load_model("tiny")
    engine = EmbeddedEngine(loaded, device="cuda")
    request = GenerateRequest([5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=16, seed=1))
    try:
        out = _run(engine.generate(request))
    finally:
        _run(engine.close())
    assert engine.device.type == "cuda" and next(loaded.model.parameters()).dtype == torch.bfloat16
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # its per-length graphs cost a decode step 3x
    ids = torch.tensor([request.input_ids + out.output_ids], device="cuda")
    with torch.no_grad():
        logits = loaded.model(ids).logits[0, len(request.input_ids) - 1 : -1].float()
    forced = logits.log_softmax(-1).gather(1, ids[0, len(request.input_ids):, None]).squeeze(1).cpu()
    assert (forced - torch.tensor(out.logprobs)).abs().max() < 0.05  # bf16: same model, cached vs one forward
