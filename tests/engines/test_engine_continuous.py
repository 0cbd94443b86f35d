"""Continuous batching in the embedded engine: requests join a running batch and leave it when they stop,
with the tokens and logprobs they would get alone (static batching, one request at a time)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.engines import chaotic_model, teacher_forced

from relax_gym.engines import EmbeddedEngine, GenerateRequest, SamplingParams
from relax_gym.engines.continuous import RunningBatch, supports_continuous_batching
from relax_gym.models import LoadedModel, load_model


@pytest.fixture(scope="module")
def chaotic() -> LoadedModel:
    """The tiny text model with N(0, 0.3) matrices, so greedy and sampled outputs vary token to token."""
    return chaotic_model("tiny")


def _requests() -> list[GenerateRequest]:
    """Different prompt lengths, output lengths, sampling params and seeds; two rows share a prompt."""
    shapes = [(3, 30, 0.0, None), (11, 5, 1.0, 11), (7, 17, 0.8, 12), (3, 9, 1.0, 13), (19, 2, 0.0, None),
              (5, 24, 0.7, 14), (11, 12, 1.0, 15)]
    return [
        GenerateRequest([10 + (7 * i + k) % 90 for k in range(length)] if length != 11 else list(range(40, 51)),
                        SamplingParams(temperature=t, max_new_tokens=n, seed=seed, top_k=20 if i == 2 else 0))
        for i, (length, n, t, seed) in enumerate(shapes)
    ]


def test_the_tiny_text_models_batch_continuously_and_media_models_statically():
    engines = [EmbeddedEngine(load_model("tiny")), EmbeddedEngine(load_model("tiny"), batching="static"),
               EmbeddedEngine(load_model("tiny-moe"))]
    try:
        assert engines[0].continuous and engines[2].continuous
        assert not engines[1].continuous
    finally:
        for engine in engines:
            asyncio.run(engine.close())
    for name in ("tiny-vl", "tiny-audio"):
        loaded = load_model(name)
        assert not supports_continuous_batching(loaded.model, loaded.processor is not None)


@pytest.mark.timeout(60)
def test_staggered_requests_get_what_each_gets_alone(chaotic):
    """Requests arrive while others run, join at the next step and leave when they stop; each gets
    the tokens (greedy and seeded) and logprobs it gets alone under static batching."""
    requests = _requests()

    async def staggered() -> list:
        engine = EmbeddedEngine(chaotic)
        try:
            tasks = []
            for request in requests:
                tasks.append(asyncio.create_task(engine.generate(request)))
                await asyncio.sleep(0.004)
            return await asyncio.gather(*tasks)
        finally:
            await engine.close()

    async def alone(request: GenerateRequest):
        engine = EmbeddedEngine(chaotic, batching="static")
        try:
            return await engine.generate(request)
        finally:
            await engine.close()

    together = asyncio.run(staggered())
    for request, out in zip(requests, together, strict=True):
        solo = asyncio.run(alone(request))
        assert out.output_ids == solo.output_ids and out.finish_reason == solo.finish_reason == "length"
        assert out.logprobs == pytest.approx(solo.logprobs, abs=1e-4)
        assert (teacher_forced(chaotic, request, out.output_ids) - torch.tensor(out.logprobs)).abs().max() < 1e-4


@pytest.mark.timeout(60)
def test_a_short_request_does_not_wait_for_a_long_one(chaotic):
    long = GenerateRequest([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=3000))
    short = GenerateRequest([8, 9], SamplingParams(temperature=0, max_new_tokens=4))

    async def scenario() -> tuple[bool, int]:
        engine = EmbeddedEngine(chaotic)
        try:
            running = asyncio.create_task(engine.generate(long))
            await asyncio.sleep(0.1)
            quick = await asyncio.wait_for(engine.generate(short), 10)
            return running.done(), len(quick.output_ids)
        finally:
            await engine.close()

    long_done, short_tokens = asyncio.run(scenario())
    assert not long_done and short_tokens == 4


def test_a_shared_prompt_is_prefilled_once_and_rows_leave_without_a_trace(chaotic):
    """The cache mechanics alone: shared prompts share cache rows; after a row leaves and another
    joins with a longer prompt, each row's next logits equal its own unbatched forward's."""
    model = chaotic.model.eval()
    batch = RunningBatch(model, pad_token_id=0)
    prompts = [[5, 6, 7], [5, 6, 7], [9, 8, 7, 6, 5]]
    first, logits = batch.prefill(prompts)
    assert len(first) == 3 and torch.equal(logits[0], logits[1])
    first.last = torch.tensor([11, 12, 13])
    batch.join(first)
    batch.step()
    order = batch.keep([1, 2])  # the first row leaves
    assert order == [2, 1]  # every column still in use: the last row moved into its place
    batch.last = torch.tensor([{1: 21, 2: 22}[row] for row in order])
    late, _ = batch.prefill([list(range(20, 40))])
    late.last = torch.tensor([14])
    batch.join(late)
    logits = batch.step()
    sequences = [[9, 8, 7, 6, 5, 13, 22], [5, 6, 7, 12, 21], [*range(20, 40), 14]]
    with torch.no_grad():
        for row, seq in enumerate(sequences):
            alone = model(input_ids=torch.tensor([seq])).logits[0, -1]
            assert (alone - logits[row]).abs().max() < 1e-4, row
    batch.keep([0, 2])  # the middle row leaves: the padding only it used goes
    assert batch.mask.shape == (2, 21) and bool(batch.mask[:, 0].any())


@pytest.mark.timeout(60)
def test_a_row_that_ends_on_its_first_token_never_joins(chaotic):
    long = GenerateRequest([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=200))
    one = GenerateRequest([8, 9], SamplingParams(temperature=0, max_new_tokens=1))

    async def scenario() -> tuple[int, int, bool]:
        engine = EmbeddedEngine(chaotic)
        try:
            running = asyncio.create_task(engine.generate(long))
            await asyncio.sleep(0.05)
            quick = await asyncio.wait_for(engine.generate(one), 10)
            return len(quick.output_ids), len((await running).output_ids), await engine.health()
        finally:
            await engine.close()

    assert asyncio.run(scenario()) == (1, 200, True)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the worker's own traceback
def test_a_failing_worker_answers_every_caller_and_reports_unhealthy(chaotic, monkeypatch):
    from relax_gym.engines import EngineError

    def broken(*_args, **_kwargs):
        raise RuntimeError("a bug in the bookkeeping")

    async def scenario() -> tuple[list, bool]:
        engine = EmbeddedEngine(chaotic)
        # the decode step's bookkeeping, not a request's admission (whose errors fail that request alone)
        monkeypatch.setattr(engine._scheduler, "_advance", broken)
        calls = [engine.generate(GenerateRequest([5 + i, 6], SamplingParams(max_new_tokens=8))) for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
        healthy = await engine.health()
        await engine.close()
        return results, healthy

    results, healthy = asyncio.run(scenario())
    assert all(isinstance(r, EngineError) and "worker failed" in str(r) for r in results) and not healthy


def test_the_cache_grows_in_place_and_gives_the_logits_a_concatenating_cache_gives(chaotic, monkeypatch):
    """`SlackLayer` writes a decode step into room it keeps (no copy of the cache per step), and rows joining and
    leaving (which replace its tensors) give the same logits as transformers' own `DynamicLayer`."""
    from transformers.cache_utils import DynamicLayer

    import relax_gym.engines.continuous as continuous

    def run() -> tuple[list[torch.Tensor], list[bool]]:
        batch, logits = RunningBatch(chaotic.model, 0).prefill([[5, 6, 7], [8, 9, 10, 11, 12]])
        batch.last = logits.argmax(-1)
        seen, in_place = [logits], []
        for step in range(70):  # past the first buffer's room (64 past the prompt) once
            if step == 10:
                other, first = RunningBatch(chaotic.model, 0).prefill([[20, 21]])
                other.last = first.argmax(-1)
                batch.join(other)
            if step == 30:
                batch.keep([0, 2])
            before = batch.cache.layers[0].keys.data_ptr()
            logits = batch.step()
            in_place.append(batch.cache.layers[0].keys.data_ptr() == before)
            batch.last = logits.argmax(-1)
            seen.append(logits)
        return seen, in_place

    slack, in_place = run()
    assert all(type(layer) is continuous.SlackLayer for layer in continuous.new_cache(chaotic.model).layers)
    monkeypatch.setattr(continuous.SlackLayer, "update", DynamicLayer.update)
    plain, _ = run()
    assert all(torch.equal(a, b) for a, b in zip(slack, plain, strict=True))
    # copies only where rows joined or left, and where the room ran out
    assert in_place.count(False) <= 4 and all(in_place[31:60])


def test_a_batch_holds_no_room_its_rows_cannot_use(chaotic):
    """With each row's budget (`room`: tokens it may still feed), a layer's buffers hold at most the positions the
    rows can come to need, never the 64 spare ones an unbounded row gets, and the logits are the same."""

    def run(budgets: bool) -> tuple[list[torch.Tensor], list[int]]:
        batch, logits = RunningBatch(chaotic.model, 0).prefill([[5, 6, 7], [8, 9, 10, 11, 12]],
                                                               room=[6, 3] if budgets else None)
        batch.last = logits.argmax(-1)
        seen, sizes = [logits], []
        for step in range(6):
            if step == 3:  # the second row has fed its 3 tokens and leaves; a row with 4 to feed joins
                batch.keep([0])
                other, first = RunningBatch(chaotic.model, 0).prefill([[20, 21]], room=[4] if budgets else None)
                other.last = first.argmax(-1)
                batch.join(other)
            logits = batch.step()
            batch.last = logits.argmax(-1)
            seen.append(logits)
            sizes.append(batch.cache.layers[0]._key_buffer.shape[-2])
        return seen, sizes

    capped, sizes = run(budgets=True)
    plain, roomy = run(budgets=False)
    assert all(torch.equal(a, b) for a, b in zip(capped, plain, strict=True))
    # 5 prompt positions + 6 to feed; after the leaving row's padding goes, 6 positions are held, and the
    # joining row, right-aligned in them, may feed 4 more (the first row 3)
    assert sizes == [11, 11, 11, 10, 10, 10] and min(roomy) >= 69


def test_a_prefix_all_prompts_share_is_prefilled_once_with_the_logits_each_gets_alone(chaotic):
    """A chat template's system turn begins every prompt: it runs once, its cache rows repeated, and each prompt's
    logits and greedy continuation are what it gets alone (up to the rounding of a different batch shape)."""
    from relax_gym.engines.continuous import MIN_PREFIX_TOKENS_SAVED, shared_prefix

    system = [30 + k % 50 for k in range(24)]
    prompts = [system + [60 + i] * (1 + i) for i in range(4)] + [[*system, 61, 62]]
    assert shared_prefix(prompts) == 24 and (len(prompts) - 1) * 24 >= MIN_PREFIX_TOKENS_SAVED
    assert shared_prefix([[1, 2], [1, 2]]) == 1 and shared_prefix([[1], [2, 3]]) == 0 and shared_prefix([]) == 0
    calls: list[int] = []
    hook = chaotic.model.register_forward_pre_hook(lambda _, args, kwargs: calls.append(kwargs["input_ids"].numel()),
                                                   with_kwargs=True)
    try:
        batch, logits = RunningBatch(chaotic.model, 0).prefill(prompts)
    finally:
        hook.remove()
    assert calls == [24, len(prompts) * 4]  # the prefix once, then each prompt's own tokens left-padded to 4
    batch.last = logits.argmax(-1)
    together = [batch.last.tolist()]
    for _ in range(6):
        batch.last = batch.step().argmax(-1)
        together.append(batch.last.tolist())
    for i, prompt in enumerate(prompts):
        alone, first = RunningBatch(chaotic.model, 0).prefill([prompt])
        assert torch.allclose(first[0], logits[i], atol=1e-4)
        alone.last = first.argmax(-1)
        tokens = [alone.last.item()]
        for _ in range(6):
            alone.last = alone.step().argmax(-1)
            tokens.append(alone.last.item())
        assert tokens == [step[i] for step in together]


def test_rows_that_leave_make_way_for_the_last_rows_and_each_row_keeps_its_own_cache(chaotic):
    """Two of five rows leave with every column still in use: the last two move into their places, and each row
    then decodes as it would alone."""
    model = chaotic.model.eval()
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14, 15, 16, 17], [18]]
    batch, logits = RunningBatch(model, pad_token_id=0).prefill(prompts)
    batch.last = torch.tensor([30, 31, 32, 33, 34])
    batch.step()
    order = batch.keep([1, 3, 4])
    assert order == [3, 1, 4]
    assert all(layer.keys.shape[0] == 3 for layer in batch.cache.layers)
    batch.last = torch.tensor([40 + row for row in order])
    logits = batch.step()
    with torch.no_grad():
        for place, row in enumerate(order):
            alone = model(input_ids=torch.tensor([[*prompts[row], 30 + row, 40 + row]])).logits[0, -1]
            assert (alone - logits[place]).abs().max() < 1e-4, row
