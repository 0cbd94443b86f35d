"""A training forward that runs each prefix a micro-batch's samples share once: a GRPO group's prompt.

A group's samples all begin with the same prompt, and on a chat model the prompt is most of each sample (SmolLM2
on 2-digit sums: 47 prompt tokens against about 15 generated). The plain forward runs every sample's prompt through
every layer, and its backward too. Here each run of consecutive samples that share a prefix runs that prefix once
with a KV cache, and the samples' own tokens (their suffixes) run on top of that cache, whose rows are gathered
from the one prefix pass (`index_select`), so the backward sums their gradients into it. The logits of the
trained tokens are those of the plain forward up to float summation order (the attention over a cached prefix is
the same sum), so the loss and its gradients are too (tests/trainer/test_prefix_forward.py).

The prefix stops one token before a run's first trained token, so every trained token's logits come from the
suffix pass, and it never holds a sample's last token. Only the models the engine's continuous batching takes
(`supports_continuous_batching`: text only, explicit positions, cache layers all full attention) take this path;
the backend keeps the plain forward for the rest, for a micro-batch where sharing saves fewer than
`MIN_TOKENS_SAVED` tokens, and under activation checkpointing (which turns the forward's cache off).

Written by hand: transformers' caches serve generation, not a training forward that backpropagates through a
shared prefix, and TRL's GRPOTrainer runs every sample's prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from relax_gym.models.forward_args import cache_argument
from relax_gym.trainer.backends.base import pad_rows

#: a micro-batch takes the shared-prefix forward when it saves at least this many token positions: below it the
#: second forward call costs more than it saves
MIN_TOKENS_SAVED = 64


@dataclass(frozen=True)
class Run:
    """Consecutive samples `start .. stop - 1` of a micro-batch that share their first `prefix` tokens."""

    start: int
    stop: int
    prefix: int


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the prefix `a` and `b` share."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _limit(token_ids: Sequence[int], loss_mask: Sequence[int]) -> int:
    """The longest prefix of a sample the prefix pass may take: up to one token before its first trained token
    (whose logits come from the token before it), and never its last token."""
    first = next((t for t, m in enumerate(loss_mask) if m), len(token_ids))
    return max(0, min(first - 1, len(token_ids) - 1))


def plan_runs(token_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]]) -> list[Run] | None:
    """The micro-batch's samples cut into runs of consecutive samples, each run sharing a prefix, so that the most
    token positions are saved; None when that is fewer than `MIN_TOKENS_SAVED`. A run of n samples sharing L tokens
    saves (n - 1) L, so a step's groups (which share a system prompt, and within a group the whole prompt) become
    a run each rather than one run over the system prompt. Pure: the same samples give the same plan."""
    n = len(token_ids)
    limits = [_limit(ids, mask) for ids, mask in zip(token_ids, loss_masks, strict=True)]
    adjacent = [_common(token_ids[i], token_ids[i + 1]) for i in range(n - 1)]
    # best[j]: the most saved over samples 0 .. j - 1, the last run starting at cut[j]
    best, cut = [0] * (n + 1), [0] * (n + 1)
    for j in range(1, n + 1):
        shared = limits[j - 1]
        best[j], cut[j] = best[j - 1], j - 1  # sample j - 1 alone
        for i in range(j - 2, -1, -1):  # the run i .. j - 1: its prefix is the least adjacent overlap and limit
            shared = min(shared, adjacent[i], limits[i])
            if shared == 0:
                break
            if best[i] + (j - 1 - i) * shared > best[j]:
                best[j], cut[j] = best[i] + (j - 1 - i) * shared, i
    if best[n] < MIN_TOKENS_SAVED:
        return None
    runs: list[Run] = []
    stop = n
    while stop > 0:
        start = cut[stop]
        prefix = min([*adjacent[start : stop - 1], *limits[start:stop]]) if stop - start > 1 else 0
        runs.append(Run(start, stop, prefix))
        stop = start
    return runs[::-1]


def _right_padded(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] ids right-padded with 0 (any id: the mask hides it), and their attention mask."""
    width = max(1, max(map(len, rows)))
    lengths = torch.tensor([len(row) for row in rows])
    mask = (torch.arange(width) < lengths[:, None]).long()
    return pad_rows(rows, width, dtype=torch.long, device=device), mask.to(device)


def _with_zero_row(rows: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """`rows` with an all-zero row appended along the batch, gathered by `row_of` (index len(rows): the zero row)."""
    return F.pad(rows, (0, 0) * (rows.dim() - 1) + (0, 1)).index_select(0, row_of)


def row_offsets(runs: Sequence[Run]) -> list[int]:
    """Each sample's prefix length (where its suffix starts), in sample order."""
    return [r.prefix for r in runs for _ in range(r.start, r.stop)]


def forward_shared(
    model: PreTrainedModel, runs: Sequence[Run], token_ids: Sequence[Sequence[int]], columns: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each run's prefix once (one batched pass with a cache), then every sample's suffix over its run's cache
    rows: the suffixes' logits at `columns` (suffix positions, as `logits_to_keep` takes them), and the suffixes'
    ids right-padded [B, S]."""
    device = columns.device
    sharing = [r for r in runs if r.prefix]
    # each sample's cache row: its run's row of the prefix pass, or for a run with no prefix an all-zero row, fully
    # masked (a row of padding alone in the prefix pass would cost its width, and its queries would attend to
    # nothing, which an attention kernel may answer with NaN that 0 weights keep)
    index = {r.start: i for i, r in enumerate(sharing)}
    row_of = torch.tensor([index.get(r.start, len(sharing)) for r in runs for _ in range(r.start, r.stop)],
                          device=device)
    offsets = row_offsets(runs)
    name = cache_argument(model)
    assert name is not None  # supports_continuous_batching checked it
    cache = DynamicCache(config=model.config)
    prefix_mask = None
    if sharing:
        ids, prefix_mask = _right_padded([token_ids[r.start][: r.prefix] for r in sharing], device)
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
        shared = getattr(model(input_ids=ids, attention_mask=prefix_mask, position_ids=positions, use_cache=True,
                               logits_to_keep=1), name)  # the output's field is named as the argument
        for layer, done in zip(cast(list[DynamicLayer], cache.layers), shared.layers, strict=True):
            layer.update(_with_zero_row(done.keys, row_of), _with_zero_row(done.values, row_of))
        prefix_mask = _with_zero_row(prefix_mask, row_of)
    suffix_ids, suffix_mask = _right_padded([ids[o:] for ids, o in zip(token_ids, offsets, strict=True)], device)
    mask = suffix_mask if prefix_mask is None else torch.cat([prefix_mask, suffix_mask], 1)
    positions = torch.tensor(offsets, device=device)[:, None] + torch.arange(suffix_ids.shape[1], device=device)
    logits = model(input_ids=suffix_ids, attention_mask=mask, position_ids=positions, use_cache=False,
                   logits_to_keep=columns, **{name: cache}).logits
    return logits, suffix_ids


def to_full_width(per_suffix: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """[B, S] values at suffix positions -> [B, T] at the samples' own positions (0 in the prefix and padding), in
    one masked write (a copy per row holds the GIL through a small model's step, as `pad_rows` says)."""
    start, stop = torch.tensor(offsets)[:, None], torch.tensor(lengths)[:, None]
    kept = (torch.arange(per_suffix.shape[1]) < stop - start).to(per_suffix.device)
    positions = torch.arange(max(lengths))
    placed = ((positions >= start) & (positions < stop)).to(per_suffix.device)
    return per_suffix.new_zeros(placed.shape).masked_scatter(placed, per_suffix[kept])
