"""Multi-process training (torchrun): rank 0 drives, the other ranks follow.

Rollouts, the engine, metrics and checkpoints' bookkeeping live on rank 0
only. The backend's methods are collective (Megatron's TP/PP/DP), so rank 0
announces each call over a gloo control group before making it, and every
other rank makes the same call with the same samples. Followers build their
loss function from the same config, so no code travels, only data.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from relax_gym.trainer.backends.base import TrainBackend
from relax_gym.trainer.backends.forwarding import Forwarder, answer
from relax_gym.trainer.batch import LossFn

_STOP = "stop"


def world() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment, before any process group exists."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _control_group() -> Any:
    return dist.new_group(backend="gloo")


class DrivingBackend(Forwarder):
    """Rank 0's view of a collective backend: every call is announced to the followers, then made here
    (`backends.forwarding`'s torchrun transport). The loss function is not sent: followers build their own."""

    def __init__(self, backend: TrainBackend):
        super().__init__(backend.version)
        self.backend = backend
        self.group = _control_group()

    def _send(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
        announced = (args[0],) if method == "train_step" else args  # (samples, loss_fn): the samples only
        dist.broadcast_object_list([(method, announced, kwargs)], src=0, group=self.group)
        return answer(self.backend, method, args, kwargs)

    def stop(self) -> None:
        dist.broadcast_object_list([(_STOP, (), {})], src=0, group=self.group)


def control_group() -> Any:
    """The gloo group rank 0 announces its calls on; every rank makes it, in the same order as its other groups
    (`DrivingBackend` makes rank 0's)."""
    return _control_group()


def follow(backend: TrainBackend, loss_fn: LossFn, group: Any | None = None) -> int:
    """A follower rank's whole life: repeat rank 0's backend calls until it stops. Returns the call count.
    `group`: the control group, if this rank made it already (`control_group`)."""
    group = group if group is not None else _control_group()
    count = 0
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        op, args, kwargs = box[0]
        if op == _STOP:
            return count
        answer(backend, op, (args[0], loss_fn) if op == "train_step" else args, kwargs)
        count += 1
