"""Attention for a decode step on a CPU, where torch's fused kernel is slow: a C loop in float32, else two matmuls.

At one query token per row, torch's CPU flash-attention kernel in bfloat16 took 1.95 ms a layer for 64 rows of
SmolLM2-135M (half of the whole step, three times its float32 time), where the two small matmuls below take a
fraction of that. In float32 too they are faster, at every shape measured (SmolLM2-135M's 9/3 heads, 16-128 rows,
64-256 cached positions): 0.35 against 0.61 ms a layer at 64 rows and 128 positions, 6 % of the engine's decode
step (float32 outputs within 6e-7 of the kernel's). Registered with transformers' `AttentionInterface` as
`relax_gym_decode`, with sdpa's mask builder: a prefill (more than one query token) goes to transformers' own sdpa
function unchanged.

In float32 with a boolean mask (the engine's case) `decode_kernel`'s C loop runs instead of the matmuls: at G = 3
query heads a key head, MKL runs the per-(row, key head) products well off the time it takes to read the cache.

Only the embedded engine's continuous batching on a CPU uses it (`EmbeddedEngine`); the trainer keeps its own
attention.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from relax_gym.cpu import decode_kernel

NAME = "relax_gym_decode"


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, H, Q, D], key and value [B, Hkv, T, D]; returns [B, Q, H, D].

    For Q = 1 the query heads are grouped by the key head they share (query head h reads key head h // (H / Hkv),
    as transformers' `repeat_kv` pairs them) and attend through `decode_kernel` where it applies, else with a
    matmul, a softmax in float32 and a matmul; a boolean mask marks what may be attended, a float one is added."""
    if query.shape[2] != 1 or dropout or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = decode_kernel.attend(query, key, value, attention_mask, scale)
    return (grouped_matmuls(query, key, value, attention_mask, scale) if out is None else out), None


def grouped_matmuls(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """One decode step's attention as a matmul, a softmax in float32 and a matmul, [B, 1, H, D] from query
    [B, H, 1, D]: where `decode_kernel` does not apply (another dtype or mask, no C compiler)."""
    rows, heads, _, dim = query.shape
    grouped = query.reshape(rows, key.shape[1], heads // key.shape[1], dim)
    # keys times queries, then a transposed view: BLAS runs [T, D] x [D, G] faster than the thin [G, D] x [D, T]
    # (G = 3 for SmolLM2; 30 layers at 64 rows x 256 positions: 28.3 against 43.8 ms in bfloat16, the engine 1.07x
    # on 64 stories; 37.9 against 44.0 ms in float32, within the engine's noise), and the softmax reads the
    # transposed scores as they are
    scores = torch.matmul(key, grouped.transpose(-1, -2)).transpose(-1, -2) * scale
    if attention_mask is not None:
        mask = attention_mask[..., -1:, : key.shape[-2]]
        scores = scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(weights, value).reshape(rows, 1, heads, dim)


def use_decode_attention(model: torch.nn.Module) -> bool:
    """Switches `model` from sdpa to `decode_attention`; False (and nothing changed) for any other attention."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)  # type: ignore[operator]
    return True
