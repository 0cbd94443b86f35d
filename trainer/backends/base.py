"""What a training backend provides, and the data it is given.

Backends only compute per-token logprobs (+ entropy), take optimizer steps
with a loss function they are handed, export weights under Hugging Face names
for the inference engine, and checkpoint. Everything algorithmic lives in
`relax_gym.trainer.algorithms` as pure functions, so torch and Megatron train
with the same maths.

The data itself (`Sample`, `MicroBatch`, `LossFn`, and how per-token arrays
align) lives in `relax_gym.trainer.batch`, which the algorithms import too.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from relax_gym.trainer.batch import LossFn, MicroBatch, Sample
from relax_gym.trainer.safe_load import numpy_rng_state, set_numpy_rng_state


@dataclass
class LogprobOutput:
    logprobs: torch.Tensor  # [T]
    entropy: torch.Tensor | None = None  # [T]


@runtime_checkable
class TrainBackend(Protocol):
    #: number of optimizer steps taken (the policy version)
    version: int

    def logprobs(self, samples: list[Sample], *, temperature: float = 1.0,
                 with_entropy: bool = False) -> list[LogprobOutput]:
        """Per-token logprobs (no grad) of `log_softmax(logits / temperature)`, as the engine reports them."""

    def train_step(self, samples: list[Sample], loss_fn: LossFn, *, temperature: float = 1.0,
                   recompute_old_logprobs: bool = False) -> dict[str, float]:
        """Forward/backward over micro-batches (token budget), clip, one optimizer step; version += 1.

        With `recompute_old_logprobs`, each sample's `old_logprobs` (what the ratio is taken against) is first
        computed from the weights about to be updated, in the same call (`attach_old_logprobs`), and the metrics
        hold `old_logprobs_s`: where the backend lives in another process (`trainer.own_process`, a Ray actor,
        torchrun's followers) the samples cross once a step, not twice."""

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Current weights under the Hugging Face names the engine's model uses (CPU tensors); in a job of several
        ranks, on rank 0 only ({} elsewhere: the others take part in gathering them)."""

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """A LoRA run's adapter (CPU copies, under the names of a PEFT folder's `adapter_model.safetensors`), for
        engines that load adapters by name; a backend that trains no adapter raises."""

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        """Model, optimizer, RNG states and the caller's `extra` (e.g. data position).

        `extra` must be plain data (None, bools, numbers, strings, lists / tuples / dicts of them): loading
        refuses anything else rather than unpickle code (see `relax_gym.trainer.safe_load`)."""

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restores what `save_checkpoint` wrote and returns `extra`; `UnsafeCheckpointError` for a file that
        holds more than tensors and plain data, unread."""


OPTIONAL_PER_TOKEN = ("old_logprobs", "ref_logprobs", "teacher_logprobs", "versions")


def attach_old_logprobs(backend: TrainBackend, samples: list[Sample], temperature: float,
                        logprobs: Callable[..., list[LogprobOutput]] | None = None) -> dict[str, float]:
    """Sets each sample's `old_logprobs` from `backend`'s current weights; `{"old_logprobs_s": seconds}`, for the
    metrics of the `train_step` that asked (`TrainBackend.train_step`'s `recompute_old_logprobs`). `logprobs`
    computes them (`backend.logprobs` by default; the torch backend passes one exact only at trained tokens)."""
    start = time.perf_counter()
    for s, o in zip(samples, (logprobs or backend.logprobs)(samples, temperature=temperature), strict=True):
        s.old_logprobs = o.logprobs.clone()  # its own storage: a view would carry its whole batch
    return {"old_logprobs_s": time.perf_counter() - start}


def check_samples(samples: Sequence[Sample], temperature: float) -> None:
    """Rejects what would otherwise fail deep inside a forward (or a collective) or silently misalign."""
    if not samples:
        raise ValueError("no samples")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        fields: dict[str, Sequence[Any] | torch.Tensor] = {"loss_mask": s.loss_mask,
                                                           "rollout_logprobs": s.rollout_logprobs}
        fields |= {f: getattr(s, f) for f in OPTIONAL_PER_TOKEN if getattr(s, f) is not None}
        if n == 0 or any(len(v) != n for v in fields.values()):
            lengths = {k: len(v) for k, v in fields.items()}
            raise ValueError(f"sample {i}: per-token fields {lengths} must match its {n} token_ids (> 0)")
        if s.loss_mask[0]:
            raise ValueError(f"sample {i}: token 0 is trained, but it has no context to be predicted from")
    for f in OPTIONAL_PER_TOKEN:
        if len({getattr(s, f) is None for s in samples}) > 1:
            raise ValueError(f"{f} is set on some samples and not others")


def pad_rows(rows: Sequence[Sequence[float] | torch.Tensor], width: int, *, dtype: torch.dtype = torch.float32,
             device: torch.device | str | None = None) -> torch.Tensor:
    """Per-token rows (lists or 1-D tensors) right-padded with 0 to [len(rows), width]; built on the CPU and moved
    once. The rows are joined into one tensor and placed by one masked write: a copy per row held the GIL for
    most of a small model's step (see `cpu_threads`)."""
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
    if lengths.numel() and int(lengths.max()) > width:
        raise ValueError(f"a row of {int(lengths.max())} values does not fit in width {width}")
    if rows and all(isinstance(row, torch.Tensor) for row in rows):
        flat = torch.cat([torch.as_tensor(row).reshape(-1) for row in rows]).to(dtype)
    else:
        flat = torch.tensor([x for row in rows for x in (row.tolist() if isinstance(row, torch.Tensor) else row)],
                            dtype=dtype)
    out = torch.zeros(len(rows), width, dtype=dtype)
    out[torch.arange(width) < lengths[:, None]] = flat
    return out.to(device) if device is not None else out


def build_micro_batch(samples: Sequence[Sample], logprobs: torch.Tensor, entropy: torch.Tensor | None, *,
                      step_tokens: int, step_sequences: int) -> MicroBatch:
    """The MicroBatch of `samples` (one per row) from their forward's [B, T] `logprobs` / `entropy`, which must
    be 0 at padding already: the samples' per-token fields right-padded with 0 to T, on the logprobs' device."""
    width, device = logprobs.size(1), logprobs.device

    def padded(rows: Sequence[Sequence[float] | torch.Tensor]) -> torch.Tensor:
        return pad_rows(rows, width, device=device)

    def optional(name: str) -> torch.Tensor | None:  # `check_samples` made it all-or-none over the step
        rows = [getattr(s, name) for s in samples]
        return None if rows[0] is None else padded(rows)

    return MicroBatch(
        logprobs=logprobs,
        entropy=entropy,
        mask=padded([s.loss_mask for s in samples]),
        advantages=padded([[s.advantage] * len(s.token_ids) for s in samples]),
        rollout_logprobs=padded([s.rollout_logprobs for s in samples]),
        old_logprobs=optional("old_logprobs"),
        ref_logprobs=optional("ref_logprobs"),
        teacher_logprobs=optional("teacher_logprobs"),
        step_tokens=step_tokens,
        step_sequences=step_sequences,
    )


def rng_states() -> dict[str, Any]:
    """Python's, numpy's and torch's (CPU and each CUDA device's) RNG states, as the plain data and tensors a
    checkpoint may hold (`relax_gym.trainer.safe_load`; numpy's own state object holds an ndarray)."""
    return {
        "python": random.getstate(),  # (version, tuple of ints, float or None)
        "numpy": numpy_rng_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_states(states: dict[str, Any]) -> None:
    """Restores what `rng_states` returned, from a file loaded onto any device (RNG states are CPU tensors)."""
    random.setstate(states["python"])
    set_numpy_rng_state(states["numpy"])
    torch.set_rng_state(states["torch"].cpu())
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, torch.Tensor):  # a Megatron checkpoint written before this helper: the current device's
            torch.cuda.set_rng_state(cuda.cpu())
        else:
            torch.cuda.set_rng_state_all([state.cpu() for state in cuda])
