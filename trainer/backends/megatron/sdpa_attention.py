"""`SDPAttention`: megatron-core's core attention through `torch.nn.functional.scaled_dot_product_attention`.

The local layer spec's `DotProductAttention` materialises the [b, heads, s, s]
score matrix (at 10k tokens and 16 heads, 6 GB per layer in fp32), and
Transformer Engine's fused attention, megatron's usual way out, has no PyPI
wheel. torch's SDPA picks a flash or memory-efficient kernel on GPUs (and a
flash kernel on CPU) that never builds the scores. Same maths: causal masking,
grouped-query heads, megatron's softmax scale and its attention dropout under
the model-parallel RNG. What it does not cover (softmax offsets, sliding
windows, attention bias, packed sequences) raises rather than differs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """`DotProductAttention`'s constructor and contract, [sq, b, np, hn] in and [sq, b, hp] out, on SDPA."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.softmax_offset is not None or self.config.window_size is not None:
            raise NotImplementedError("SDPAttention: softmax offsets and sliding windows are not supported")
        #: the scale the scores get in all: the parent divides its scale by the layer number under query-key
        #: layer scaling and has the softmax multiply it back
        self.scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)

    def forward(  # megatron's signature; the optional arguments it cannot take are refused
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("SDPAttention: attention bias and packed sequences are not supported")
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, hn]
        mask = None
        if attention_mask is not None:  # megatron's mask is True where attention is NOT allowed
            mask = ~attention_mask
            if causal:
                mask = mask & torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril()
        dropout = self.attention_dropout.p if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None,
                scale=self.scale,
                enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition,
            )
        # [b, np, sq, hn] -> [sq, b, hp]
        return context.permute(2, 0, 1, 3).reshape(context.size(2), context.size(0), self.hidden_size_per_partition)
