"""Training backends: the contract (`base`) and the plain-PyTorch backend.

The Megatron backend lives in `relax_gym.trainer.backends.megatron` and is
imported from there, so megatron-core stays an optional dependency.
"""

from relax_gym.trainer.backends.base import LogprobOutput, TrainBackend
from relax_gym.trainer.backends.logprob_kernel import token_logprobs
from relax_gym.trainer.backends.torch_backend import TorchBackend, pack_micro_batches
from relax_gym.trainer.batch import LossFn, MicroBatch, Sample

__all__ = [
    "LogprobOutput",
    "LossFn",
    "MicroBatch",
    "Sample",
    "TorchBackend",
    "TrainBackend",
    "pack_micro_batches",
    "token_logprobs",
]
