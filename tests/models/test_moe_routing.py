"""Routed experts recorded in one forward and replayed in another (`relax_gym.models.moe_routing`, R3's core):
replaying a forward's own routes changes nothing, other routes change the output, the routers still get
gradients, and a token's route does not depend on the batch it is in. Engines return them as SGLang does
(`return_routed_experts`), in-process and over HTTP."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from support.engines import KEY, serving

from relax_gym.engines import EmbeddedEngine, GenerateRequest, RequestError, SamplingParams, SGLangEngine
from relax_gym.models import LoadedModel, load_model
from relax_gym.models.moe_routing import recording, replaying, routers


def sharpened() -> LoadedModel:
    """tiny-moe whose routers are far from uniform (a random router's logits are near-equal), the same each call."""
    loaded = load_model("tiny-moe")
    with torch.no_grad():
        for router in routers(loaded.model):
            router.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    return loaded


@pytest.fixture(scope="module")
def moe():
    return sharpened().model


IDS = torch.tensor([[5, 17, 300, 42, 9, 77, 123, 8]])


def _routes(model, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    with recording(model) as routes, torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits
    return logits, torch.stack([layer[0] for layer in routes])


def test_the_moe_model_has_a_router_per_layer_and_the_dense_one_none(moe):
    assert len(routers(moe)) == moe.config.num_hidden_layers
    assert routers(load_model("tiny").model) == []


def test_replaying_a_forwards_own_routes_changes_nothing_and_other_routes_change_the_output(moe):
    logits, routes = _routes(moe, IDS)
    assert routes.shape == (2, IDS.numel(), 2)
    with replaying(moe, routes), torch.no_grad():
        assert torch.equal(moe(input_ids=IDS).logits, logits)
    other = (routes + 1) % moe.config.num_experts
    with replaying(moe, other), torch.no_grad():
        assert not torch.allclose(moe(input_ids=IDS).logits, logits)
    assert torch.equal(_routes(moe, IDS)[0], logits)  # the routers are their own again after the block


def test_a_token_without_a_recorded_route_keeps_the_routers_own_choice(moe):
    """-1 marks tokens with no recorded route: they route as without replay, the others as replayed."""
    logits, routes = _routes(moe, IDS)
    other = (routes + 1) % moe.config.num_experts
    with replaying(moe, torch.full_like(routes, -1)), torch.no_grad():
        assert torch.equal(moe(input_ids=IDS).logits, logits)  # nothing recorded: the model's own forward
    mixed = other.clone()
    mixed[:, 4:] = -1  # the last four tokens unrecorded
    with recording(moe) as taken, replaying(moe, mixed), torch.no_grad():
        moe(input_ids=IDS)
    replayed = torch.stack([layer[0] for layer in taken])
    assert torch.equal(replayed[:, :4], other[:, :4])
    assert not torch.equal(replayed[:, 4:], other[:, 4:])  # their own choice, not the shifted one


def test_replayed_routes_still_train_the_routers(moe):
    _, routes = _routes(moe, IDS)
    other = (routes + 3) % moe.config.num_experts
    with replaying(moe, other):
        moe.zero_grad()
        moe(input_ids=IDS).logits.sum().backward()
    grads = [router.weight.grad for router in routers(moe)]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    moe.zero_grad()


def test_a_tokens_route_does_not_depend_on_its_batch(moe):
    """A row alone and the same row left-padded in a batch with another: the same routes for its tokens, so an
    engine's routes can be replayed in the trainer's differently shaped batch."""
    _, alone = _routes(moe, IDS)
    longer = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])
    pad = longer.shape[1] - IDS.shape[1]
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), IDS], 1), longer])
    mask = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(IDS)], 1),
                      torch.ones_like(longer)])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    _, batched = _routes(moe, batch, attention_mask=mask, position_ids=positions)
    first_row = batched.view(2, 2, longer.shape[1], 2)[:, 0, pad:]
    assert torch.equal(first_row, alone)


def test_routes_of_the_wrong_shape_are_refused(moe):
    wrong = pytest.raises(ValueError, match=r"expected \[2 routers, tokens, top_k\]")
    with wrong, replaying(moe, torch.zeros(3, 8, 2, dtype=torch.long)):
        pass
    short = pytest.raises(ValueError, match=r"replayed routes of shape \(5, 2\) for 8 tokens")
    with short, replaying(moe, torch.zeros(2, 5, 2, dtype=torch.long)), torch.no_grad():
        moe(input_ids=IDS)


REQUEST = GenerateRequest([5, 17, 300, 42, 9], SamplingParams(temperature=1.0, max_new_tokens=6, seed=3),
                          return_routed_experts=True)


def _engine_routes(out, model) -> torch.Tensor:
    layers, top_k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    return torch.from_numpy(out.routed_experts.copy()).view(-1, layers, top_k)


def test_the_engine_returns_the_routes_the_trainer_takes_for_every_token_it_ran(moe):
    """As SGLang's `return_routed_experts`: int32 [token, layer, top_k] for prompt and output but the last token;
    the trainer's own forward of those tokens (fp32, as the engine here) routes every one of them alike."""
    async def run(engine: EmbeddedEngine):
        try:
            return await engine.generate(REQUEST)
        finally:
            await engine.close()

    out = asyncio.run(run(EmbeddedEngine(sharpened())))
    routes = _engine_routes(out, moe)
    ran = [*REQUEST.input_ids, *out.output_ids][:-1]
    assert out.routed_experts.dtype == np.int32 and routes.shape == (len(ran), 2, 2)
    _, trainer = _routes(moe, torch.tensor([ran]))
    assert torch.equal(routes, trainer.permute(1, 0, 2).to(torch.int32))


def test_routes_come_over_http_as_sglang_encodes_them_and_a_dense_model_has_none(moe):
    async def both(client: SGLangEngine, local: EmbeddedEngine):
        try:
            return await client.generate(REQUEST), await local.generate(REQUEST)
        finally:
            await client.close()
            await local.close()

    with serving(sharpened()) as (url, _):
        remote, local = asyncio.run(both(SGLangEngine(url, api_key=KEY), EmbeddedEngine(sharpened())))
    assert remote.output_ids == local.output_ids
    assert np.array_equal(remote.routed_experts, local.routed_experts)

    async def dense(engine: EmbeddedEngine):
        try:
            with pytest.raises(RequestError, match=r"return_routed_experts: model 'tiny' has no mixture-of-experts"):
                await engine.generate(REQUEST)
        finally:
            await engine.close()

    asyncio.run(dense(EmbeddedEngine(load_model("tiny"))))
