"""Per-token logprobs and entropy from vocabulary-parallel logits: the torch backend's chunked kernel
(`logprob_kernel`) told which slice of the vocabulary this tensor-parallel rank holds and which group holds the
rest, so the softmax statistics are reduced over that group without gathering the logits."""

from __future__ import annotations

import torch
from megatron.core import parallel_state as mpu

from relax_gym.trainer.backends.logprob_kernel import VocabSlice, token_logprobs


def vocab_parallel_token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0, *, with_entropy: bool = False,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` (its arguments and alignment) from this rank's logits [B, S, V/tp], over the whole
    vocabulary: position t scores token t given tokens < t, position 0 is 0; fp32, differentiable."""
    parallel = mpu.get_tensor_model_parallel_world_size() > 1
    vocab = VocabSlice(mpu.get_tensor_model_parallel_rank() * logits.shape[-1],
                       mpu.get_tensor_model_parallel_group() if parallel else None)
    return token_logprobs(logits, input_ids, temperature, with_entropy=with_entropy, chunk_rows=chunk_rows,
                          vocab=vocab)
