"""`backends.forwarding`: a backend used through a `Forwarder` trains exactly as the backend used directly, and a
step's old logprobs are taken in the update's own call (the samples cross once)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from relax_gym.models import load_model
from relax_gym.trainer.algorithms import AlgorithmConfig, make_loss_fn
from relax_gym.trainer.backends.base import TrainBackend
from relax_gym.trainer.backends.forwarding import Forwarder, answer
from relax_gym.trainer.backends.torch_backend import TorchBackend
from relax_gym.trainer.batch import Sample


class Loopback(Forwarder):
    """The simplest transport: the far side is this process, every call recorded."""

    def __init__(self, backend: TrainBackend) -> None:
        super().__init__(backend.version)
        self.backend, self.sent = backend, []

    def _send(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
        self.sent.append(method)
        return answer(self.backend, method, copy.deepcopy(args), kwargs)  # what crosses is a copy, as on a pipe


def _samples() -> list[Sample]:
    rows = [([5, 17, 300, 42, 9, 11], 0.5), ([8, 3, 120, 7], -0.5), ([21, 4, 4, 90, 61], 1.0)]
    samples = []
    for ids, advantage in rows:
        sample = Sample(ids, [0, 0] + [1] * (len(ids) - 2), [0.0, 0.0] + [-1.0] * (len(ids) - 2))
        sample.advantage = advantage
        samples.append(sample)
    return samples


def test_a_forwarded_backend_trains_as_the_backend_itself_in_one_call_a_step(tmp_path) -> None:
    loss_fn = make_loss_fn(AlgorithmConfig())
    direct = TorchBackend(load_model("tiny"), seed=0)
    forwarded = Loopback(TorchBackend(load_model("tiny"), seed=0))
    for step in range(2):
        here = direct.train_step(_samples(), loss_fn, temperature=0.7, recompute_old_logprobs=True)
        there = forwarded.train_step(_samples(), loss_fn, temperature=0.7, recompute_old_logprobs=True)
        assert here.pop("old_logprobs_s") > 0 and there.pop("old_logprobs_s") > 0
        assert here == there and forwarded.version == direct.version == step + 1
    assert forwarded.sent == ["train_step", "train_step"]  # the old logprobs came with the update
    ours, theirs = direct.hf_state_dict(), forwarded.hf_state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    forwarded.save_checkpoint(tmp_path / "ckpt", {"at": 2})
    forwarded.version = 7
    assert forwarded.version == forwarded.backend.version == 7
    assert forwarded.load_checkpoint(tmp_path / "ckpt") == {"at": 2} and forwarded.version == 2


def test_only_backend_calls_are_answered() -> None:
    with pytest.raises(ValueError, match="not a backend call: '__init__'"):
        answer(TorchBackend(load_model("tiny")), "__init__", (), {})
