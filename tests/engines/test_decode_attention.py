"""`decode_attention` (the bfloat16 CPU engine's decode step) against transformers' own sdpa attention, and
`rollout.engine_dtype: bfloat16` end to end: the engine casts its own copy, the trainer's model keeps float32."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.engines import chaotic_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from relax_gym.cpu.decode_attention import NAME, decode_attention, use_decode_attention
from relax_gym.engines import GenerateRequest, SamplingParams, make_engine
from relax_gym.engines.continuous import RunningBatch
from relax_gym.trainer.config import load_rollout_config


class _Grouped(torch.nn.Module):
    """What transformers' attention functions read from the module: 9 query heads over 3 key heads."""

    num_key_value_groups = 3
    is_causal = True


def _inputs(dtype: torch.dtype, queries: int = 1) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(shape, generator=generator).to(dtype)
                 for shape in ((4, 9, queries, 16), (4, 3, 10, 16), (4, 3, 10, 16)))


def _masks(queries: int) -> list[torch.Tensor | None]:
    keep = torch.ones(4, 1, queries, 10, dtype=torch.bool)
    keep[0, ..., :3] = False  # left padding
    keep[2, ..., 5:7] = False  # a hole: a shared prefix's padding sits between it and the prompt's own tokens
    return [None, keep, torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)]


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_a_decode_step_attends_as_sdpa_does(dtype, atol):
    query, key, value = _inputs(dtype)
    for mask in _masks(1):
        mask = mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)
        ours, _ = decode_attention(_Grouped(), query, key, value, mask, scaling=0.25)
        theirs, _ = sdpa_attention_forward(_Grouped(), query, key, value, mask, scaling=0.25)
        assert ours.shape == theirs.shape == (4, 1, 9, 16)
        assert torch.allclose(ours.float(), theirs.float(), atol=atol)


def test_a_prefill_goes_to_sdpa_unchanged():
    query, key, value = _inputs(torch.float32, queries=10)
    mask = _masks(10)[1]
    ours, _ = decode_attention(_Grouped(), query, key, value, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(_Grouped(), query, key, value, mask, scaling=0.25)
    assert torch.equal(ours, theirs)


def test_a_model_decoding_with_it_gives_the_logits_it_gives_with_sdpa():
    chaotic = chaotic_model("tiny")

    def decode() -> list[torch.Tensor]:
        batch, logits = RunningBatch(chaotic.model, 0).prefill([[5, 6, 7, 8], [9, 10]])
        seen = [logits]
        for _ in range(8):
            batch.last = seen[-1].argmax(-1)
            seen.append(batch.step())
        return seen

    before = decode()
    assert use_decode_attention(chaotic.model) and chaotic.model.config._attn_implementation == NAME
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(before, decode(), strict=True))
    assert not use_decode_attention(chaotic.model)  # only sdpa is switched


def test_a_bfloat16_engine_casts_its_own_copy_and_takes_float32_weight_updates():
    loaded = chaotic_model("tiny")
    cfg = load_rollout_config({}, ["rollout.engine_dtype=bfloat16", "rollout.engine_device=cpu"])
    engine = make_engine(loaded, cfg)

    async def run() -> list[int]:
        request = GenerateRequest([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=6))
        first = await engine.generate(request)
        weights = {name: tensor.clone() for name, tensor in loaded.model.state_dict().items()}  # the trainer's
        await engine.update_weights(weights, 1)
        again = await engine.generate(request)
        assert again.weight_version == 1 and again.output_ids == first.output_ids  # the same weights
        return first.output_ids

    try:
        assert len(asyncio.run(run())) == 6
        model = engine.model  # type: ignore[attr-defined]
        assert model.dtype == torch.bfloat16 and model.config._attn_implementation == NAME
        assert loaded.model.dtype == torch.float32 and model is not loaded.model
    finally:
        asyncio.run(engine.close())
