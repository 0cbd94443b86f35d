"""Megatron-core training backend: TP/PP/DP `GPTModel`, HF weights in and out through mbridge.

Needs the `megatron` extra (megatron-core, mbridge, einops). Runs on CPU through
`compat` (gloo, no CUDA) and on GPUs unchanged.
"""

from relax_gym.trainer.backends.megatron.backend import MegatronBackend

__all__ = ["MegatronBackend"]
