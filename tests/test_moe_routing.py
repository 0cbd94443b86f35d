"""Routed experts recorded in one forward and replayed in another (`relax_gym.models.moe_routing`, R3's core):
replaying a forward's own routes changes nothing, other routes change the output, the routers still get
gradients, and a token's route does not depend on the batch it is in."""

from __future__ import annotations

import pytest
import torch

from relax_gym.models import load_model
from relax_gym.models.moe_routing import recording, replaying, routers


@pytest.fixture(scope="module")
def moe():
    loaded = load_model("tiny-moe")
    with torch.no_grad():  # a random router is near-uniform; sharper logits make routes that matter
        for router in routers(loaded.model):
            router.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    return loaded.model


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
