"""The embedded engine's weight I/O: reading an update (a state dict or an HF folder of *.safetensors), checking
every key and shape against the model before anything is copied, and the copy itself, which the worker makes
between batches (it is the only thread that touches the model), with the version it sets.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from relax_gym.engines.base import EngineError, RequestError
from relax_gym.engines.request_queue import AdapterChange, Update, resolve
from relax_gym.engines.resident_adapters import ResidentAdapters


class ModelWeights:
    """The model's weights as updates change them, and their version (0 until the first update)."""

    def __init__(self, model: PreTrainedModel, name: str, adapters: ResidentAdapters) -> None:
        self.model = model
        self.name = name
        self.adapters = adapters
        self.version = 0

    def checked(self, weights: Any) -> dict[str, torch.Tensor]:
        """`weights` as {model parameter name: tensor}; raises an EngineError naming any bad key or shape."""
        if isinstance(weights, (str, os.PathLike)):
            weights = read_checkpoint(Path(weights))
        if not isinstance(weights, Mapping) or not weights:
            raise RequestError(f"update_weights: expected a non-empty state dict or folder, got {type(weights)}")
        if self.adapters:
            raise RequestError(f"update_weights: LoRA adapters are loaded ({sorted(self.adapters.folders)}): unload "
                               "them before updating the base weights")
        targets = self.model.state_dict(keep_vars=True)
        checked: dict[str, torch.Tensor] = {}
        for key, value in weights.items():
            name = key if key in targets else self._checkpoint_names.get(key)
            if name is None:
                raise RequestError(f"update_weights: {key!r} is not a parameter of {self.name!r}")
            if problem := weight_problem(value, targets[name]):
                raise RequestError(f"update_weights: {key!r} {problem}")
            checked[name] = value
        return checked

    @functools.cached_property
    def _checkpoint_names(self) -> dict[str, str]:
        """Checkpoint key → parameter name, where save_pretrained renames keys (e.g. Qwen2-Audio's
        `audio_tower.*` is `model.audio_tower.*` in memory): inverts transformers' own renaming."""
        state = self.model.state_dict()
        by_id = {id(t): name for name, t in state.items()}
        saved = revert_weight_conversion(self.model, dict(state))
        return {key: by_id[id(t)] for key, t in saved.items() if id(t) in by_id}

    def apply(self, update: Update | AdapterChange) -> None:
        """Applies a queued update on the worker thread, and answers its caller."""
        if isinstance(update, AdapterChange):
            try:
                update.change()
            except Exception as err:  # a refused adapter: the caller's error; the model is as it was
                resolve(update.loop, update.future, err if isinstance(err, EngineError) else EngineError(
                    f"changing the LoRA adapters failed: {err!r}"))
                return
            resolve(update.loop, update.future, None)
            return
        targets = self.model.state_dict(keep_vars=True)
        try:
            with torch.no_grad():
                for name, value in update.tensors.items():
                    targets[name].copy_(value)
        except Exception as err:  # a copy that fails part way leaves mixed weights: say so
            resolve(update.loop, update.future, EngineError(f"update_weights failed part way: {err!r}"))
            return
        self.version = update.version
        resolve(update.loop, update.future, None)


def weight_problem(value: Any, target: torch.Tensor) -> str | None:
    """Why `value` cannot be copied into `target`: not a tensor, another shape, a dtype that is not the same
    kind (a float cast to another float is fine), or a value that is not finite. None if it can."""
    if not isinstance(value, torch.Tensor):
        return f"is a {type(value).__name__}, not a tensor"
    if value.shape != target.shape:
        return f"has shape {tuple(value.shape)}, the model's is {tuple(target.shape)}"
    if value.is_floating_point() != target.is_floating_point() or (
        not target.is_floating_point() and value.dtype != target.dtype
    ):
        return f"has dtype {value.dtype}, the model's is {target.dtype}"
    if value.is_floating_point() and not all_finite(value):
        return "holds NaN or infinite values"
    return None


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite. A NaN or an infinity makes the sum non-finite, so one reduction (no
    tensor-sized mask: ~50x faster on a CPU) settles the usual case; only a sum that overflows is checked
    element by element."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's *.safetensors shards (or of one .safetensors file)."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() and f.suffix == ".safetensors" for f in files):
        raise RequestError(f"update_weights: no *.safetensors at {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors
