"""RL algorithms as pure functions over tensors: advantages, policy losses, corrections, aggregation.

`make_loss_fn(AlgorithmConfig(...))` composes them into the `LossFn` a backend trains with.
"""

from relax_gym.trainer.algorithms.advantages import filter_uniform_groups, group_advantages
from relax_gym.trainer.algorithms.aggregate import AGGREGATIONS, Aggregation, aggregate, masked
from relax_gym.trainer.algorithms.corrections import importance_mask, truncated_importance_weights
from relax_gym.trainer.algorithms.loss_fn import Algorithm, AlgorithmConfig, make_loss_fn, sft_loss_fn
from relax_gym.trainer.algorithms.losses import (
    KLKind,
    distillation_token_loss,
    entropy_bonus,
    grpo_token_loss,
    gspo_token_loss,
    kl_penalty,
    sapo_token_loss,
)

__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "Algorithm",
    "AlgorithmConfig",
    "KLKind",
    "aggregate",
    "distillation_token_loss",
    "entropy_bonus",
    "filter_uniform_groups",
    "group_advantages",
    "grpo_token_loss",
    "gspo_token_loss",
    "importance_mask",
    "kl_penalty",
    "make_loss_fn",
    "masked",
    "sapo_token_loss",
    "sft_loss_fn",
    "truncated_importance_weights",
]
