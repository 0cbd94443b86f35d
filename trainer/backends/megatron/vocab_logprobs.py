"""Per-token logprobs and entropy from vocabulary-parallel logits, one chunk of rows alive at a time.

Each tensor-parallel rank holds logits [B, S, V/tp] for its slice of the
vocabulary. The softmax statistics are reduced over the TP group without
gathering the logits: per chunk of rows, one MAX all-reduce for the shift and
one SUM all-reduce for the sum of exponentials, the target's logit and the
exp-weighted logit sum (for the entropy). Autograd through those ops would keep
several fp32 [rows, V/tp] tensors per op for backward (at 10k tokens and a
152k vocabulary, tens of GB); `_VocabParallelLogprobs` keeps only the logits
and per-row statistics and recomputes each chunk's softmax in backward, as the
torch backend's `_TokenLogprobs` does on one device. The gradient of a rank's
slice needs only the global per-row statistics, so backward has no collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from relax_gym.trainer.backends.torch_backend import compute_dtype, logprob_grad, scaled_logits

#: elements of one fp32 [rows, V/tp] working chunk (128 MiB), whatever the vocabulary and sequence length
CHUNK_ELEMENTS = 2**25


class _VocabParallelLogprobs(torch.autograd.Function):
    """Rows of this rank's logits [N, V/tp] → log p(target) [N] and entropy [N] of softmax(logits / T) over the
    whole vocabulary."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        group = mpu.get_tensor_model_parallel_group()
        parallel = mpu.get_tensor_model_parallel_world_size() > 1
        rows, width = logits.shape
        local = targets - mpu.get_tensor_model_parallel_rank() * width
        here = (local >= 0) & (local < width)
        local = local.clamp(0, width - 1)
        lse = logits.new_empty(rows, dtype=compute_dtype(logits))
        logprobs = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else lse.new_empty(0)
        for start in range(0, rows, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            z = scaled_logits(logits[chunk], temperature)
            shift = z.max(dim=-1).values
            if parallel:
                dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
            # clamped, -inf logits (a masked vocabulary) give 0 * finite = 0, not 0 * -inf = NaN, in the entropy
            z.sub_(shift[:, None]).clamp_(min=torch.finfo(z.dtype).min)
            sums = [z.gather(-1, local[chunk, None]).squeeze(-1) * here[chunk]]
            p = z.exp()
            sums.append(p.sum(dim=-1))
            if with_entropy:
                sums.append((p * z).sum(dim=-1))
            stacked = torch.stack(sums)
            if parallel:
                dist.all_reduce(stacked, group=group)
            log_sum = stacked[1].log()
            lse[chunk] = shift + log_sum
            logprobs[chunk] = stacked[0] - log_sum
            if with_entropy:
                entropy[chunk] = log_sum - stacked[2] / stacked[1]
        ctx.save_for_backward(logits, local, here, lse, entropy)
        ctx.temperature, ctx.with_entropy, ctx.chunk_rows = temperature, with_entropy, chunk_rows
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, local, here, lse, entropy = ctx.saved_tensors
        grad = logprob_grad(logits, local, here, lse, entropy, grad_logprobs,
                            grad_entropy if ctx.with_entropy else None, ctx.temperature, ctx.chunk_rows)
        return grad, None, None, None, None


def vocab_parallel_token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0, *, with_entropy: bool = False,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token `log_softmax(logits / T)` of the next token (+ entropy) from vocab-parallel logits: the
    tensor-parallel counterpart of the torch backend's `token_logprobs`, with its arguments and alignment.

    `logits` is [B, S, V/tp] (this rank's vocabulary slice), `input_ids` [B, S].
    Returns fp32 [B, S] tensors aligned as the contract says: position t scores
    token t given tokens < t, position 0 is 0. Differentiable; `chunk_rows`
    (default: `CHUNK_ELEMENTS` worth) bounds the working memory beyond the logits.
    """
    batch, length, width = logits.shape
    targets = input_ids.roll(-1, dims=1)  # the last position's target wraps around and is dropped below
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // width)
    logprobs, entropy = _VocabParallelLogprobs.apply(logits.reshape(-1, width), targets.reshape(-1), temperature,
                                                     with_entropy, rows)

    def aligned(per_row: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(per_row.view(batch, length)[:, :-1], (1, 0))

    return aligned(logprobs), aligned(entropy) if with_entropy else None
