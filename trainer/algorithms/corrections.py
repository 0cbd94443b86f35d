"""Off-policy corrections for the gap between the engine's logprobs and the trainer's.

The inference engine (rollout) and the trainer (old policy, recomputed before the update) disagree
even at the same weights (kernels, precision, MoE routing) and more so with stale samples. These
functions reweight or mask the policy loss by π_old / π_rollout; the results are detached.
Metrics are per-token [B, T] tensors, reduced like the loss (see `losses`).
"""

from __future__ import annotations

from typing import Literal

import torch

from relax_gym.trainer.algorithms.aggregate import masked

Level = Literal["token", "sequence"]


def truncated_importance_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, *,
                                 cap: float = 2.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level truncated importance sampling (TIS): w = min(π_old / π_rollout, cap), detached.

    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
    (fengyao.notion.site); as in slime and veRL. The cap bounds the variance that rare tokens with a
    tiny rollout probability would add.
    """
    raw = torch.exp(old_logprobs - rollout_logprobs).detach()
    weights = raw.clamp(max=cap)
    return weights, {"tis_weight": weights, "tis_capped": (raw > cap).float()}


def importance_mask(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                    low: float, high: float, level: Level) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked importance sampling (MIS): keep-mask [B, T] dropping tokens whose π_old / π_rollout leaves [low, high].

    At ``sequence`` level the ratio is the geometric mean over the sequence's valid tokens and a whole
    sequence is dropped at once (veRL's rollout rejection sampling, slime's MIS). Unlike TIS, a
    masked token contributes nothing rather than a capped weight. Padded positions are never kept.
    """
    valid = mask.bool()
    log_ratio = masked(old_logprobs - rollout_logprobs, valid).detach()
    if level == "sequence":
        lengths = valid.sum(dim=-1, keepdim=True).clamp(min=1)
        log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / lengths).expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"unknown MIS level {level!r}; expected 'token' or 'sequence'")
    ratio = torch.exp(log_ratio)
    keep = valid & (ratio >= low) & (ratio <= high)
    return keep, {"mis_masked": (valid & ~keep).float()}
