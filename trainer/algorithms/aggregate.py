"""Reduce per-token values to one scalar, normalised by optimizer-step totals so micro-batches add up."""

from __future__ import annotations

from typing import Literal, get_args

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` where `mask`, else 0, with `torch.where` so NaN/inf in padded positions cannot leak.

    Multiplying by the mask would give NaN * 0 = NaN; `where` also routes an exact zero gradient to
    the padded positions.
    """
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, *, mode: Aggregation, step_tokens: int,
              step_sequences: int) -> torch.Tensor:
    """Scalar from a [B, T] per-token tensor over the valid positions of `mask`.

    - ``token-mean``: sum of all valid tokens / step_tokens (DAPO, arXiv:2503.14476: every token
      weighs the same, so long answers are not under-weighted);
    - ``seq-mean-token-mean``: sum over sequences of their token mean / step_sequences (original
      GRPO, arXiv:2402.03300);
    - ``seq-mean-token-sum``: sum over sequences of their token sum / step_sequences (Dr.GRPO-style,
      arXiv:2503.20783: no per-sequence length normalisation).

    `step_tokens` / `step_sequences` are the totals of the whole optimizer step, so the values of the
    micro-batches of a step sum exactly to the value over the whole step, however it is split.
    """
    values = masked(per_token, mask)
    if mode == "token-mean":
        return values.sum() / step_tokens
    if mode == "seq-mean-token-sum":
        return values.sum() / step_sequences
    if mode == "seq-mean-token-mean":
        lengths = mask.bool().sum(dim=-1).clamp(min=1)
        return (values.sum(dim=-1) / lengths).sum() / step_sequences
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")
