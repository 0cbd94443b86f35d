"""The routed experts of a mixture-of-experts model: recorded in one forward, replayed in another (R3).

An MoE layer's router picks each token's top-k experts from its own logits, so two forwards that differ in
the last bit (the engine in bf16, the trainer in fp32; another batch shape) can route a token to other
experts, and the trainer's logprobs then describe a policy the engine never ran. Rollout routing replay
(R3) records the engine's choices and makes the trainer's routers take them. The routers still train: the
weights of the replayed experts are the router's own softmax probabilities at those experts, so the
gradient reaches the router as it would have had it chosen them.

Routers are found by what transformers' MoE routers have in common (Qwen3-MoE's `Qwen3MoeTopKRouter`:
`top_k`, `num_experts`, a `weight`, and a forward on [tokens, hidden] giving (logits, top-k weights, top-k
indices)); a model without them has no routes. Routes are per router, in the model's layer order, each a
[tokens, top_k] tensor of expert indices in the order the router sees the tokens: the batch flattened row
by row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from relax_gym.engines.base import GenerateOutput, GenerateRequest


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers, in layer order ([] for a dense model)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("Router") and all(hasattr(m, a) for a in ("top_k", "num_experts", "weight"))]


def experts_per_token(config: Any) -> int | None:
    """The model's top-k (`num_experts_per_tok`, as Qwen3-MoE, Mixtral and DeepSeek name it), None if dense."""
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(getattr(config, "text_config", None),
                                                                    "num_experts_per_tok", None)
    return int(top_k) if top_k else None


def shaped_routes(flat: np.ndarray, tokens: int, top_k: int) -> np.ndarray:
    """An engine's flat routed experts (SGLang's layout: [token, layer, top_k] in row-major order) for the
    `tokens` it ran, as an int16 [tokens, layers, top_k] array; ValueError when the sizes do not divide."""
    if tokens <= 0 or flat.size % (tokens * top_k):
        raise ValueError(f"{flat.size} routed experts do not divide into {tokens} tokens x layers x top_k {top_k}")
    return flat.astype(np.int16).reshape(tokens, -1, top_k)


def request_routes(request: GenerateRequest, out: GenerateOutput, top_k: int) -> np.ndarray:
    """The routed experts an engine's answer `out` carries for every token `request` ran (its prompt and all
    output tokens but the last), [tokens, layers, top_k]; ValueError saying why when there are none or they
    do not fit."""
    if out.routed_experts is None:
        raise ValueError("no routed experts in its answer (an SGLang server needs --enable-return-routed-experts)")
    try:
        return shaped_routes(out.routed_experts, len(request.input_ids) + len(out.output_ids) - 1, top_k)
    except ValueError as err:
        raise ValueError(f"routed experts of request {request.rid!r}: {err}") from None


def batch_routes(per_row: Sequence[np.ndarray | torch.Tensor | None], width: int, layers: int,
                 top_k: int) -> torch.Tensor:
    """[layers, rows x width, top_k] routes for a right-padded batch of rows `width` wide, flattened row by row
    as a router sees it (what `replaying` takes): each row's recorded [tokens, layers, top_k] routes at its
    first positions, -1 (the router's own choice) wherever none was recorded."""
    out = torch.full((layers, len(per_row), width, top_k), -1, dtype=torch.long)
    for row, routes in enumerate(per_row):
        if routes is None or len(routes) == 0:
            continue
        routes = torch.as_tensor(routes)
        if routes.dim() != 3 or routes.shape[1:] != (layers, top_k) or routes.shape[0] > width:
            raise ValueError(f"row {row}: routes of shape {tuple(routes.shape)} for a batch of width {width}, "
                             f"{layers} routed layers and top_k {top_k}")
        out[:, row, : routes.shape[0]] = routes.permute(1, 0, 2)
    return out.reshape(layers, -1, top_k)


@contextmanager
def recording(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Yields one list per router that each forward inside the block appends its [tokens, top_k] indices to."""
    found = routers(model)
    routes: list[list[torch.Tensor]] = [[] for _ in found]

    def keep(layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> None:
            routes[layer].append(output[2].detach())
        return hook

    handles = [router.register_forward_hook(keep(i)) for i, router in enumerate(found)]
    try:
        yield routes
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def replaying(model: nn.Module, routes: torch.Tensor) -> Iterator[None]:
    """Inside the block every forward's routers take `routes` ([routers, tokens, top_k] indices, for the
    tokens of one forward, flattened as the routers see them) instead of their own top-k; the top-k weights
    are the router's softmax probabilities at those experts, renormalised when the model renormalises its own.
    A token whose route is -1 (none was recorded: padding, tokens after the engine's last forward) keeps the
    router's own choice."""
    found = routers(model)
    if routes.dim() != 3 or routes.shape[0] != len(found):
        raise ValueError(f"routes of shape {tuple(routes.shape)}: expected [{len(found)} routers, tokens, top_k]")

    def replayed(router: nn.Module, chosen: torch.Tensor) -> Any:
        weight, top_k = cast(torch.Tensor, router.weight), int(cast(int, router.top_k))
        renormalise = bool(getattr(router, "norm_topk_prob", False))

        def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            hidden = hidden_states.reshape(-1, weight.shape[1])
            if chosen.shape != (hidden.shape[0], top_k):
                raise ValueError(f"replayed routes of shape {tuple(chosen.shape)} for {hidden.shape[0]} tokens and "
                                 f"top_k {top_k}")
            logits = nn.functional.linear(hidden, weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            index = chosen.to(device=logits.device, dtype=torch.long)
            unrecorded = (index < 0).any(dim=-1).nonzero().squeeze(-1)
            if len(unrecorded):  # the router's own top-k for those tokens only
                index = index.index_put((unrecorded,), torch.topk(probs[unrecorded], top_k, dim=-1).indices)
            weights = probs.gather(-1, index)
            if renormalise:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), index
        return forward

    try:
        for router, chosen in zip(found, routes, strict=True):
            router.forward = replayed(router, chosen)
        yield
    finally:
        for router in found:
            router.__dict__.pop("forward", None)  # the class's own forward again
