"""Group-relative advantages and DAPO's dynamic-sampling filter, computed once per sample before training."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

GroupIds = torch.Tensor | Sequence[Hashable]


def _group_index(group_ids: GroupIds, n: int) -> tuple[torch.Tensor, int]:
    """Dense group index in [0, G) per sample, and G; ids may be a tensor or any hashables (e.g. strings)."""
    if isinstance(group_ids, torch.Tensor):
        _, index = torch.unique(group_ids, return_inverse=True)
    else:
        dense: dict[Hashable, int] = {}
        index = torch.tensor([dense.setdefault(g, len(dense)) for g in group_ids], dtype=torch.long)
    if index.numel() != n:
        raise ValueError(f"{index.numel()} group ids for {n} rewards")
    return index, int(index.max()) + 1 if n else 0


def group_advantages(rewards: torch.Tensor, group_ids: GroupIds, *, std_normalize: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Reward minus its group's mean, divided by the group's std when `std_normalize`.

    GRPO (Shao et al. 2024, arXiv:2402.03300) normalises by the std; Dr.GRPO (Liu et al. 2025,
    arXiv:2503.20783) drops the division because it up-weights groups whose rewards barely differ.
    The std is the unbiased one (Bessel), as `torch.std` in TRL and veRL; a group of one sample has
    advantage 0.
    """
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    index, n_groups = _group_index(group_ids, rewards.numel())
    return _relative(rewards, index, n_groups, std_normalize=std_normalize, eps=eps)


def _relative(rewards: torch.Tensor, index: torch.Tensor, n_groups: int, *, std_normalize: bool,
              eps: float) -> torch.Tensor:
    """Each reward minus its group's mean (over `index`, dense in [0, n_groups)), over the group's std if asked."""
    count = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, index, torch.ones_like(rewards))
    mean = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, index, rewards) / count
    centred = rewards - mean[index]
    if not std_normalize:
        return centred
    sq_sum = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, index, centred**2)
    std = (sq_sum / (count - 1).clamp(min=1)).sqrt()
    return centred / (std[index] + eps)


def filter_uniform_groups(rewards: torch.Tensor, group_ids: GroupIds) -> torch.Tensor:
    """Keep-mask [N] that drops groups whose rewards are all equal.

    DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): such groups have zero advantage for
    every sample, so they only dilute the batch.
    """
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    index, n_groups = _group_index(group_ids, rewards.numel())
    high = torch.full((n_groups,), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, index, rewards, "amax")
    low = torch.full((n_groups,), torch.inf, dtype=rewards.dtype).scatter_reduce(0, index, rewards, "amin")
    return (high > low)[index]
