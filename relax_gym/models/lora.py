"""LoRA adapters on a loaded model, through peft: added for training, merged for the engines, read back from a
PEFT adapter folder.

peft injects its layers into the model in place (`get_peft_model(model).base_model.model is model`), so the
trainer keeps driving the same transformers class (its `logits_to_keep`, caches and prefix forward unchanged) and
holds the `PeftModel` only to save the adapter. What reaches an engine is the merged weight of each adapted
layer, `W + B @ A * alpha / r`, under the layer's own transformers name: the other weights are the base's and
never change, so an engine that loaded the base needs only those (a state dict that names part of the model).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from relax_gym.errors import StartupError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "ALL_LINEAR",
    "LoraError",
    "LoraSpec",
    "adapter_base",
    "adapter_tensors",
    "add_adapter",
    "is_adapter_folder",
    "linear_names",
    "load_adapter_weights",
    "merged_adapter",
    "merged_weights",
    "quiet_peft",
    "save_adapter",
    "write_adapter",
]

#: the two files of a PEFT adapter folder (what `PeftModel.save_pretrained` writes; peft, vLLM and SGLang read them)
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
#: `target_modules` meaning every linear layer of the language model but its output head (peft's own word)
ALL_LINEAR = "all-linear"


class LoraError(StartupError):
    """A LoRA setting the model cannot take, or an adapter that does not fit it; the message names the field (the
    CLI's one line and exit 2)."""


@dataclass(frozen=True)
class LoraSpec:
    """One adapter's shape (`trainer.lora`): rank r, alpha (the update is scaled by alpha / r; None: 2 x rank),
    dropout on the adapter's input while training, and the layers it adapts (leaf names such as "q_proj", or
    "all-linear")."""

    rank: int = 16
    alpha: int | None = None
    dropout: float = 0.0
    target_modules: str | Sequence[str] = ALL_LINEAR

    def __post_init__(self) -> None:
        if self.alpha is None:
            object.__setattr__(self, "alpha", 2 * self.rank)


def linear_names(model: nn.Module) -> list[str]:
    """The leaf names of `model`'s linear layers but its output head: what "all-linear" adapts."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and module is not head and name})


def _targets(model: nn.Module, spec: LoraSpec) -> list[str]:
    """`spec.target_modules` as leaf names, each checked against the model's linear layers."""
    linears = linear_names(model)
    if spec.target_modules == ALL_LINEAR:
        return linears
    asked = [spec.target_modules] if isinstance(spec.target_modules, str) else list(spec.target_modules)
    missing = [name for name in asked if name not in linears]
    if missing or not asked:
        raise LoraError(f"trainer.lora.target_modules: {missing or asked} {'is' if len(missing) == 1 else 'are'} "
                        f"not a linear layer of {type(model).__name__}; its linear layers are {linears} (or say "
                        f"{ALL_LINEAR!r})")
    return asked


def _absolute(base_name: str) -> str:
    """A base that is a folder is named absolutely, so its adapter loads from anywhere; a name stays a name."""
    path = Path(base_name).expanduser()
    return str(path.resolve()) if path.is_dir() else base_name


def _config(spec: LoraSpec, model: nn.Module, base_name: str) -> Any:
    """peft's `LoraConfig` of `spec` on `model` (its targets as leaf names), naming the base absolutely."""
    from peft import LoraConfig

    if spec.rank < 1:
        raise LoraError(f"trainer.lora.rank must be at least 1, got {spec.rank}")
    return LoraConfig(r=spec.rank, lora_alpha=cast(int, spec.alpha), lora_dropout=spec.dropout,  # set: __post_init__
                      target_modules=_targets(model, spec), bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=_absolute(base_name))


def add_adapter(model: nn.Module, spec: LoraSpec, base_name: str) -> Any:
    """Injects a fresh adapter into `model` in place (its B is zero, so the model answers as before) and freezes
    everything else; returns the `PeftModel`, whose `save_pretrained` writes the adapter folder naming
    `base_name` as its base."""
    from peft import get_peft_model

    config = _config(spec, model, base_name)
    # peft takes the base's name from the model (None for one made in memory), over the config's
    setattr(model, "name_or_path", config.base_model_name_or_path)  # noqa: B010
    with quiet_peft():
        return get_peft_model(model, config)


@contextmanager
def quiet_peft() -> Iterator[None]:
    """peft 0.21 asks transformers 5 for a name it deprecated (`is_gradient_checkpointing`): a FutureWarning at
    every adapter, which says nothing to the user."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def save_adapter(peft_model: Any, files: Any, path: Path) -> None:
    """The PEFT adapter folder: `adapter_config.json` and `adapter_model.safetensors`, with `files` (the
    tokenizer or processor, and so the chat template) beside them, as TRL saves one. Embedding layers are never
    adapted here, so peft's check of the base's vocabulary (a Hub lookup for a name that is no folder) is
    skipped."""
    peft_model.save_pretrained(str(path), save_embedding_layers=False)
    files.save_pretrained(str(path))


def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of each adapted layer's merged weight (`W + delta`), under its transformers name (the name
    the layer's weight has without the adapter): the part of the model an adapter changes."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer) and module.active_adapters:
                layer: Any = module  # a lora.Linear: get_delta_weight is on the layer classes, not on LoraLayer
                weight = layer.get_base_layer().weight
                for adapter in (a for a in layer.active_adapters if a in layer.lora_A):
                    weight = weight + layer.get_delta_weight(adapter)
                out[f"{name}.weight"] = weight.to("cpu", copy=True)
    return out


def adapter_tensors(peft_model: Any) -> dict[str, torch.Tensor]:
    """CPU copies of the adapter's weights under peft's saved names (`adapter_model.safetensors`'s)."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}


def write_adapter(path: Path, tensors: dict[str, torch.Tensor], spec: LoraSpec, model: nn.Module,
                  base_name: str) -> Path:
    """An adapter folder of `tensors` (`adapter_tensors`' names) for `model`, the base it adapts (its layers name
    the targets), without the tokenizer: what an engine that loads adapters by name reads."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    _config(spec, model, base_name).save_pretrained(str(path))
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return path


def is_adapter_folder(path: Path) -> bool:
    """Whether `path` is a PEFT adapter folder (an adapter config and no model config of its own)."""
    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def adapter_base(path: Path) -> str:
    """The base model an adapter folder names (`base_model_name_or_path`)."""
    config = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    base = config.get("base_model_name_or_path")
    if not base:
        raise LoraError(f"{path / ADAPTER_CONFIG} names no base_model_name_or_path, so its base cannot be loaded")
    return str(base)


def load_adapter_weights(peft_model: Any, path: Path) -> None:
    """Loads the adapter folder at `path` into `peft_model`'s adapter in place (a resume). An adapter of another
    rank, other layers or another base is refused, naming what differs."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    ours = peft_model.peft_config["default"]
    for key, want in (("r", ours.r), ("lora_alpha", ours.lora_alpha),
                      ("target_modules", sorted(ours.target_modules))):
        got = sorted(saved.get(key) or []) if key == "target_modules" else saved.get(key)
        if got != want:
            raise LoraError(f"adapter {path}: its {key} is {got}, the run's trainer.lora says {want}")
    try:
        result = set_peft_model_state_dict(peft_model, load_file(str(path / ADAPTER_WEIGHTS)))
    except RuntimeError as err:  # a size mismatch: the adapter of another base model
        raise LoraError(f"adapter {path} does not fit the model {ours.base_model_name_or_path!r} (another base?): "
                        f"{str(err).splitlines()[-1].strip()}") from None
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise LoraError(f"adapter {path} has weights the model lacks (another base?): {unexpected[:3]}")


def merged_adapter(model: Any, path: Path) -> Any:
    """`model` with the adapter folder at `path` merged into its weights: a plain transformers model again."""
    from peft import PeftModel

    try:
        with quiet_peft():
            return PeftModel.from_pretrained(model, str(path)).merge_and_unload()
    except RuntimeError as err:
        raise LoraError(f"adapter {path} does not fit its base model (another base?): "
                        f"{str(err).splitlines()[-1].strip()}") from None
