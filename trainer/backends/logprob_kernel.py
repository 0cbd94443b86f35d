"""Per-token logprobs and entropy of softmax(logits / T), one chunk of rows alive at a time: the one kernel the
torch backend (the whole vocabulary on one device) and Megatron (each tensor-parallel rank's slice of it) share.

Autograd through `log_softmax` would keep a full fp32 [N, V] copy per op for the backward pass (at 10k tokens
and a 152k vocabulary, tens of GB). `ChunkedLogprobs` keeps only the logits and per-row statistics and
recomputes each chunk's softmax in backward, so the only [N, V] tensors alive are the logits and, in backward,
their gradient. On a vocabulary slice the statistics are reduced over the slice's group without gathering the
logits: per chunk, one MAX all-reduce for the shift and one SUM all-reduce for the sum of exponentials, the
target's logit and the exp-weighted logit sum (for the entropy). The gradient of a slice needs only those
global per-row statistics, so backward has no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

#: Elements of one fp32 [rows, V] working chunk (128 MiB): bounds the extra memory beyond the logits themselves,
#: whatever the vocabulary and sequence length.
CHUNK_ELEMENTS = 2**25


@dataclass(frozen=True)
class VocabSlice:
    """Where this rank's logits sit in the vocabulary: the id of its first column, and the process group holding
    the other slices (None: the whole vocabulary is here)."""

    start: int = 0
    group: Any = None


WHOLE_VOCABULARY = VocabSlice()


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for bf16 / fp16 logits (log-probabilities need it), else the logits' own (fp64 stays fp64)."""
    return torch.promote_types(logits.dtype, torch.float32)


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A fresh copy of `logits / temperature` in the compute dtype, safe to modify in place."""
    return logits.to(compute_dtype(logits)).div(temperature)


class ChunkedLogprobs(torch.autograd.Function):
    """Rows of logits [N, V] (or a slice's [N, V/tp]) -> log p(target) [N] and entropy [N] of softmax(logits / T)
    over the whole vocabulary, `chunk_rows` rows at a time."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                chunk_rows: int, vocab: VocabSlice) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = logits.shape
        local = targets - vocab.start
        here = ((local >= 0) & (local < width)) if vocab.group is not None else None
        local = local.clamp(0, width - 1)
        lse = logits.new_empty(rows, dtype=compute_dtype(logits))
        logprobs = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else lse.new_empty(0)
        for start in range(0, rows, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            z = scaled_logits(logits[chunk], temperature)
            shift = z.max(dim=-1).values
            if vocab.group is not None:
                dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=vocab.group)
            # clamped, -inf logits (a masked vocabulary) give 0 * finite = 0, not 0 * -inf = NaN, in the entropy
            z.sub_(shift[:, None]).clamp_(min=torch.finfo(z.dtype).min)
            target = z.gather(-1, local[chunk, None]).squeeze(-1)
            p = z.exp() if with_entropy else z.exp_()  # the entropy needs z too; else it is done with
            sums = [target if here is None else target * here[chunk], p.sum(dim=-1)]
            if with_entropy:
                sums.append((p * z).sum(dim=-1))
            stacked = torch.stack(sums)
            if vocab.group is not None:
                dist.all_reduce(stacked, group=vocab.group)
            log_sum = stacked[1].log()
            lse[chunk] = shift + log_sum
            logprobs[chunk] = stacked[0] - log_sum
            if with_entropy:
                entropy[chunk] = log_sum - stacked[2] / stacked[1]
        ctx.save_for_backward(logits, local, lse, entropy, *(() if here is None else (here,)))
        ctx.temperature, ctx.with_entropy, ctx.chunk_rows = temperature, with_entropy, chunk_rows
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, local, lse, entropy, *here = ctx.saved_tensors
        grad = logprob_grad(logits, local, here[0] if here else None, lse, entropy, grad_logprobs,
                            grad_entropy if ctx.with_entropy else None, ctx.temperature, ctx.chunk_rows)
        return grad, None, None, None, None, None


def logprob_grad(logits: torch.Tensor, targets: torch.Tensor, here: torch.Tensor | None, lse: torch.Tensor,
                 entropy: torch.Tensor, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None,
                 temperature: float, chunk_rows: int) -> torch.Tensor:
    """d(grad_logprobs · log p_target + grad_entropy · H) / d logits for rows of logits [N, V] under
    softmax(logits / T), each chunk's softmax recomputed from its row's log-sum-exp `lse` (and entropy `H`).

    d log p_y / dz = onehot(y) - p and d H / dz = -p (log p + H), with `p log p` as `xlogy(p, p)`: 0 where a
    masked logit makes p 0, so no 0 * -inf turns the gradient NaN. The logits may be one rank's slice of the
    vocabulary, `targets` indices into it and `here` whether each row's target is in it (None: all are);
    `lse` and `H` are then the whole vocabulary's, and the gradient needs nothing else from other ranks."""
    grad = torch.empty_like(logits)
    for start in range(0, logits.shape[0], chunk_rows):
        chunk = slice(start, start + chunk_rows)
        p = scaled_logits(logits[chunk], temperature).sub_(lse[chunk, None]).exp_()
        g_lp = grad_logprobs[chunk, None]
        if grad_entropy is None:
            g_z = p.mul_(-g_lp)
        else:
            g_z = (torch.special.xlogy(p, p).add_(p * entropy[chunk, None]).mul_(-grad_entropy[chunk, None])
                   .sub_(p.mul_(g_lp)))
        g_z.scatter_add_(-1, targets[chunk, None], g_lp if here is None else g_lp * here[chunk, None])
        grad[chunk] = g_z.div_(temperature)
    return grad


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    chunk_rows: int | None = None,
    columns: torch.Tensor | None = None,
    vocab: VocabSlice = WHOLE_VOCABULARY,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] log p(token t | < t) under softmax(logits / temperature), and that distribution's entropy.

    `logits` [B, T, V] (a tensor-parallel rank's [B, T, V/tp] with `vocab`) come from a forward over `input_ids`
    [B, T]; row t predicts token t + 1, so outputs are shifted right by one and position 0 (no context) is 0, the
    alignment of `Trajectory.rollout_logprobs`. With `columns` [K] (ascending positions < T - 1), `logits`
    [B, K, V] are those positions' only, as a forward with `logits_to_keep=columns` returns them, and the outputs
    are 0 everywhere else: a training step needs only the trained tokens, and on a small model the vocabulary
    projection and its softmax over every position cost as much as the rest of the model. fp32 (fp64 for fp64
    logits) whatever the logits' dtype. Differentiable; `chunk_rows` (default: `CHUNK_ELEMENTS` worth) bounds the
    working memory beyond the logits.
    """
    batch, length = input_ids.shape
    width = logits.shape[-1]
    # without columns the last position's target is never used (it wraps around)
    targets = input_ids.roll(-1, dims=1) if columns is None else input_ids[:, columns + 1]
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // width)
    logprobs, entropy = ChunkedLogprobs.apply(logits.reshape(-1, width), targets.reshape(-1), temperature,
                                              with_entropy, rows, vocab)

    def aligned(per_row: torch.Tensor) -> torch.Tensor:
        per_row = per_row.view(batch, -1)
        if columns is None:
            return F.pad(per_row[:, :-1], (1, 0))
        return per_row.new_zeros(batch, length).index_copy(1, columns + 1, per_row)

    return aligned(logprobs), aligned(entropy) if with_entropy else None
