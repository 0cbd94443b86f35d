"""The one way a training backend is used from another process: `Forwarder` on the caller's side, `answer` on the
side where the weights live.

Three transports carry a `TrainBackend` call today, and each is only a `_send`:
- `trainer.own_process`'s pipe to a spawned child (`backends.process.ProcessBackend`);
- a Ray actor, trainer rank 0 of a cluster run (`cluster.ray_handles.RemoteBackend` to `cluster.roles.TrainerRank`);
- torchrun's control group, rank 0 announcing each call to the other ranks, which repeat it
  (`distributed.DrivingBackend` and `distributed.follow`).

A call is (method, args, kwargs) of plain data (paths as strings), and its reply is (result, the backend's version
after it), so the caller's `version` follows every call without asking again. One call a step carries the samples:
`train_step` takes the old logprobs itself (`recompute_old_logprobs`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from relax_gym.trainer.backends.base import LogprobOutput, TrainBackend
from relax_gym.trainer.batch import LossFn, Sample

#: what `answer` dispatches: the `TrainBackend` methods, and the version's setter
METHODS = frozenset({"logprobs", "train_step", "hf_state_dict", "adapter_state_dict", "save_checkpoint",
                     "load_checkpoint", "set_version"})


def answer(backend: TrainBackend, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
    """Makes the call `Forwarder._call` sent on `backend`; (its result, the version after it)."""
    if method not in METHODS:
        raise ValueError(f"not a backend call: {method!r}")
    if method == "set_version":
        backend.version = args[0]
        return None, backend.version
    if method in ("save_checkpoint", "load_checkpoint"):
        args = (Path(args[0]), *args[1:])
    return getattr(backend, method)(*args, **kwargs), backend.version


class Forwarder:
    """`TrainBackend` over a backend elsewhere: every method is one `_send((method, args, kwargs))`, which a
    transport delivers to `answer` there and whose (result, version) it returns."""

    def __init__(self, version: int = 0) -> None:
        self._version = version

    def _send(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
        raise NotImplementedError

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result, self._version = self._send(method, args, kwargs)
        return result

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        self._call("set_version", value)

    def logprobs(self, samples: list[Sample], *, temperature: float = 1.0,
                 with_entropy: bool = False) -> list[LogprobOutput]:
        outs: list[LogprobOutput] = self._call("logprobs", samples, temperature=temperature, with_entropy=with_entropy)
        return outs

    def train_step(self, samples: list[Sample], loss_fn: LossFn, *, temperature: float = 1.0,
                   recompute_old_logprobs: bool = False) -> dict[str, float]:
        metrics: dict[str, float] = self._call("train_step", samples, loss_fn, temperature=temperature,
                                               recompute_old_logprobs=recompute_old_logprobs)
        return metrics

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = self._call("hf_state_dict")
        return state

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = self._call("adapter_state_dict")
        return state

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        self._call("save_checkpoint", str(path), extra)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        extra: dict[str, Any] = self._call("load_checkpoint", str(path))
        return extra
