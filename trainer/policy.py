"""The run's policy and its training backend, built from the config: the pieces every place that trains needs
(the in-process loop, its own-process backend, a cluster's trainer ranks and rollout workers), in a module that
imports none of them, so none of them imports another to get these."""

from __future__ import annotations

import copy

from relax_gym.models import LoadedModel, load_model
from relax_gym.trainer.backends.base import TrainBackend
from relax_gym.trainer.config import TrainConfig


def load_policy(cfg: TrainConfig) -> LoadedModel:
    """The policy as the config's `model` section describes it (folder, template, template kwargs, tool format)."""
    m = cfg.model
    return load_model(m.path, chat_template=m.chat_template, template_kwargs=m.template_kwargs,
                      tool_format=m.tool_format)


def make_backend(cfg: TrainConfig, loaded: LoadedModel) -> TrainBackend:
    """The training backend `trainer.backend` names, over a copy of `loaded` (the engine keeps the original)."""
    t = cfg.trainer
    if t.backend == "megatron":
        from relax_gym.trainer.backends.megatron import MegatronBackend  # megatron-core only when asked for

        return MegatronBackend(copy.deepcopy(loaded), tp=t.megatron.tp, pp=t.megatron.pp, ep=t.megatron.ep, lr=t.lr,
                               weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                               micro_batch_tokens=t.micro_batch_tokens, seed=cfg.seed, dtype=t.megatron.dtype,
                               replay_routes=cfg.algorithm.routing_replay)
    from relax_gym.trainer.backends.torch_backend import TorchBackend

    return TorchBackend(copy.deepcopy(loaded), lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                        micro_batch_tokens=t.micro_batch_tokens, seed=cfg.seed,
                        gradient_checkpointing=t.gradient_checkpointing,
                        replay_routes=cfg.algorithm.routing_replay,
                        lora=t.lora.spec() if t.lora is not None else None)
