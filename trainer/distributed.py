"""Multi-process training (torchrun): rank 0 drives, the other ranks follow.

Rollouts, the engine, metrics and checkpoints' bookkeeping live on rank 0
only. The backend's methods are collective (Megatron's TP/PP/DP), so rank 0
announces each call over a gloo control group before making it, and every
other rank makes the same call with the same samples. Followers build their
loss function from the same config, so no code travels, only data.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from relax_gym.trainer.backends.base import LogprobOutput, TrainBackend
from relax_gym.trainer.batch import LossFn, Sample

_STOP = "stop"


def world() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment, before any process group exists."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _control_group() -> Any:
    return dist.new_group(backend="gloo")


class DrivingBackend:
    """Rank 0's view of a collective backend: every call is announced to the followers first."""

    def __init__(self, backend: TrainBackend):
        self.backend = backend
        self.group = _control_group()

    def _announce(self, op: str, *args: Any, **kwargs: Any) -> None:
        dist.broadcast_object_list([(op, args, kwargs)], src=0, group=self.group)

    @property
    def version(self) -> int:
        return self.backend.version

    @version.setter
    def version(self, value: int) -> None:
        self._announce("set_version", value)
        self.backend.version = value

    def logprobs(self, samples: list[Sample], **kwargs: Any) -> list[LogprobOutput]:
        self._announce("logprobs", samples, **kwargs)
        return self.backend.logprobs(samples, **kwargs)

    def train_step(self, samples: list[Sample], loss_fn: LossFn, **kwargs: Any) -> dict[str, float]:
        self._announce("train_step", samples, **kwargs)
        return self.backend.train_step(samples, loss_fn, **kwargs)

    def hf_state_dict(self) -> dict[str, Any]:
        self._announce("hf_state_dict")
        return self.backend.hf_state_dict()

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        self._announce("save_checkpoint", str(path), extra)
        self.backend.save_checkpoint(path, extra)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        self._announce("load_checkpoint", str(path))
        return self.backend.load_checkpoint(path)

    def stop(self) -> None:
        self._announce(_STOP)


def control_group() -> Any:
    """The gloo group rank 0 announces its calls on; every rank makes it, in the same order as its other groups
    (`DrivingBackend` makes rank 0's)."""
    return _control_group()


def follow(backend: TrainBackend, loss_fn: LossFn, group: Any | None = None) -> int:
    """A follower rank's whole life: repeat rank 0's backend calls until it stops. Returns the call count.
    `group`: the control group, if this rank made it already (`control_group`)."""
    group = group if group is not None else _control_group()
    calls: dict[str, Callable[..., Any]] = {
        "logprobs": backend.logprobs,
        "train_step": lambda samples, **kw: backend.train_step(samples, loss_fn, **kw),
        "hf_state_dict": backend.hf_state_dict,
        "save_checkpoint": lambda path, extra: backend.save_checkpoint(Path(path), extra),
        "load_checkpoint": lambda path: backend.load_checkpoint(Path(path)),
        "set_version": lambda value: setattr(backend, "version", value),
    }
    count = 0
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        op, args, kwargs = box[0]
        if op == _STOP:
            return count
        calls[op](*args, **kwargs)
        count += 1
