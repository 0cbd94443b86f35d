"""The data a training step works on: `Sample` (one trajectory as the trainer consumes it), `MicroBatch`
(padded tensors for one forward/backward) and `LossFn` (what the algorithms build and a backend calls).

Both the pure maths (`relax_gym.trainer.algorithms`) and the backends import these, so the maths needs
no backend module.

Alignment: for a sequence of T tokens, per-token arrays have length T and
position t refers to token t given tokens < t; position 0 (no context) is 0.
This matches `Trajectory.rollout_logprobs` and `loss_mask`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Sample:
    """One trajectory as the trainer consumes it."""

    token_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    advantage: float = 0.0
    #: processor outputs for this sample's images / audio (pixel_values, image_grid_thw, input_features, ...)
    mm_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    #: filled by the loop before the update when the algorithm needs them: [T] tensors (aligned as above), kept
    #: as the backend's `logprobs` gave them; old logprobs a backend takes itself (`train_step`'s
    #: `recompute_old_logprobs`) may be exact only at trained tokens, where the losses read them (the torch
    #: backend computes only those, and may leave the rest 0)
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    #: per-token policy versions (-1 where masked), for staleness metrics
    versions: list[int] | None = None
    #: the engine's routed experts, [tokens, layers, top_k] (`Trajectory.routed_experts`), which a backend made
    #: with routing replay makes its routers take
    routed_experts: np.ndarray | None = None


@dataclass
class MicroBatch:
    """Right-padded [B, T] tensors for one forward/backward; `mask` is loss_mask with padding zeroed."""

    #: with grad; exact where `mask` is 1, and a backend may leave the untrained positions 0 (the torch
    #: backend projects only the trained positions onto the vocabulary), so a loss reads them under `mask`
    logprobs: torch.Tensor
    entropy: torch.Tensor | None  # as `logprobs`: exact where `mask` is 1
    mask: torch.Tensor
    advantages: torch.Tensor  # per token (the sample's advantage broadcast over its tokens)
    rollout_logprobs: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    teacher_logprobs: torch.Tensor | None
    #: totals over the WHOLE optimizer step (all micro-batches, all ranks), so per-micro-batch losses
    #: normalised by them sum to the step's mean exactly, whatever the micro-batching
    step_tokens: int
    step_sequences: int


#: (micro-batch) -> (loss to backpropagate, metrics summed over the step by the backend)
LossFn = Callable[[MicroBatch], tuple[torch.Tensor, dict[str, float]]]
