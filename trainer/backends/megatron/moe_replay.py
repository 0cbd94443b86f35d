"""Routing replay (R3) on megatron-core's MoE routers, through its own `RouterReplay`.

megatron-core (≥ 0.16, `moe_enable_routing_replay`) gives every `TopKRouter` a `RouterReplay` that, in
`REPLAY_FORWARD`, takes the given top-k expert indices instead of its own and gathers their scores, so the
gate weights and the router's gradient are the router's own at those experts. What it does not do, and this
module adds:

- the layout: a micro-batch's routes, recorded per sample as [tokens, layers, top_k], are laid out as the
  router sees its tokens, megatron's sequence-first [s, b] flattened (token t of row r at t x b + r), and
  each router gets its own global layer's routes (pipeline stages hold some layers only);
- tokens with no recorded route (-1: padding, the last token, samples without routes) keep the router's
  own choice, where the stock replay would index with -1;
- a step's routes are dropped when it ends: the stock replay keeps every target for a recompute in the
  backward pass (the backend recomputes no activations), which would grow without bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from relax_gym.models.moe_routing import batch_routes

_stock_replay_topk = RouterReplay.get_replay_topk


def _replay_topk(self: RouterReplay, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                 group_topk: int | None = None, default_compute_topk: Callable[..., Any] | None = None) -> Any:
    """The stock replay, but a token whose replayed route is -1 takes the router's own top-k."""
    target = self.target_topk_idx
    if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD or target is None or not (target < 0).any():
        return _stock_replay_topk(self, scores, topk, num_groups, group_topk, default_compute_topk)
    assert default_compute_topk is not None  # megatron's router always passes it
    _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    target = target.to(scores.device)
    indices = torch.where((target < 0).any(dim=-1, keepdim=True), own, target)
    return scores.gather(1, indices), indices


RouterReplay.get_replay_topk = _replay_topk  # the -1 rule above, process-wide


def sequence_first_routes(per_row: Sequence[np.ndarray | None], width: int, layers: int,
                          top_k: int) -> torch.Tensor:
    """[layers, width x rows, top_k] routes of a right-padded micro-batch in megatron's token order
    (sequence-first), -1 where none was recorded."""
    rows = batch_routes(per_row, width, layers, top_k).view(layers, len(per_row), width, top_k)
    return rows.transpose(1, 2).reshape(layers, width * len(per_row), top_k)


def replay(model: torch.nn.Module, routes: torch.Tensor | None) -> None:
    """Sets `model`'s routers (this pipeline stage's) to replay `routes` ([all layers, tokens, top_k]) in the
    next forward, or to route freely when `routes` is None."""
    for module in model.modules():
        if not isinstance(module, TopKRouter) or module.router_replay is None:
            continue
        router_replay = module.router_replay
        router_replay.clear_indices()
        if routes is None:
            router_replay.clear_router_replay_action()
            continue
        router_replay.set_target_indices(routes[module.layer_number - 1])
        router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def forget(model: torch.nn.Module) -> None:
    """Every router of `model` routes freely again, its replayed routes dropped."""
    replay(model, None)
