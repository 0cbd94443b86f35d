"""`load_model`: one entry point for the embedded tiny models and local HF checkpoint folders.

Nothing here reaches a hub: a name is either one of `TINY_MODELS` or a folder on
disk, read with `local_files_only=True`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMultimodalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING
from transformers.utils import is_torchvision_available
from transformers.utils import logging as hf_logging

from relax_gym.errors import StartupError
from relax_gym.models.tiny import build_tiny_audio, build_tiny_text, build_tiny_vl, without_video

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model with what turns messages into its inputs; `processor` is None for text-only models."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    processor: ProcessorMixin | None
    modalities: tuple[str, ...]
    name: str


TINY_MODELS: tuple[str, ...] = ("tiny", "tiny-vl", "tiny-audio")


def _build_tiny(name: str) -> LoadedModel:
    if name == "tiny":
        model, tokenizer = build_tiny_text()
        return LoadedModel(model, tokenizer, None, ("text",), name)
    build, modality = {"tiny-vl": (build_tiny_vl, "image"), "tiny-audio": (build_tiny_audio, "audio")}[name]
    model, processor = build()
    return LoadedModel(model, processor.tokenizer, processor, ("text", modality), name)


def config_modalities(config: PretrainedConfig) -> tuple[str, ...]:
    """Which input modalities a checkpoint takes, read from its sub-configs."""
    found = ["text"]
    if getattr(config, "vision_config", None) is not None:
        found.append("image")
    if getattr(config, "audio_config", None) is not None:
        found.append("audio")
    return tuple(found)


class ModelLoadError(StartupError):
    """A model name or folder that cannot be loaded; the message says which and why."""


def _not_found(name_or_path: str, why: str) -> ModelLoadError:
    return ModelLoadError(
        f"model {name_or_path!r}: {why}. Pass a local Hugging Face checkpoint folder (config.json, "
        f"tokenizer or processor files, *.safetensors) or an embedded tiny model: {', '.join(TINY_MODELS)}. "
        "Nothing is downloaded from a hub."
    )


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file()


def load_model(
    name_or_path: str, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> LoadedModel:
    """A tiny model by name, else a local checkpoint folder; `dtype=None` keeps fp32 / the saved dtype.

    A checkpoint folder whose name is also a tiny model's (`./tiny-vl`) wins: the
    user who has one there means it. Any failure to read a folder is a
    `ModelLoadError` naming the folder and the cause.
    """
    path = Path(name_or_path).expanduser()
    if name_or_path in TINY_MODELS and not _is_checkpoint(path):
        loaded = _build_tiny(name_or_path)
        loaded.model.to(device=device, dtype=dtype)
        return loaded
    if name_or_path in TINY_MODELS:
        log.warning("model %r: using the checkpoint folder %s, not the embedded tiny model of that name",
                    name_or_path, path.resolve())
    if not path.is_dir():
        raise _not_found(name_or_path, f"no folder at {path}")
    if not _is_checkpoint(path):
        raise _not_found(name_or_path, f"the folder {path} has no config.json")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per shard is noise in a run's one screen of output
    try:
        return _load_folder(path, dtype, device)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError, SafetensorError) as err:
        # transformers reports a bad folder in many types (empty config: ValueError, no weights: OSError,
        # a truncated safetensors file: SafetensorError, a RuntimeError); the user needs one line
        raise ModelLoadError(f"model folder {path}: cannot load it: {type(err).__name__}: {_first_line(err)}") from err
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def _load_folder(path: Path, dtype: torch.dtype | None, device: str | torch.device) -> LoadedModel:
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    modalities = config_modalities(config)
    auto_model = AutoModelForCausalLM if modalities == ("text",) else AutoModelForMultimodalLM
    model = auto_model.from_pretrained(path, local_files_only=True, dtype=dtype or "auto").to(device)
    if modalities == ("text",):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return LoadedModel(model, tokenizer, None, modalities, str(path))
    processor_cls = PROCESSOR_MAPPING[type(config)]
    if not is_torchvision_available():
        processor_cls = without_video(processor_cls)
    processor = processor_cls.from_pretrained(path, local_files_only=True)
    return LoadedModel(model, processor.tokenizer, processor, modalities, str(path))


def save_model(loaded: LoadedModel, path: str | Path) -> Path:
    """Writes a folder `load_model` reads: safetensors, config, tokenizer / processor, chat template."""
    path = Path(path)
    loaded.model.save_pretrained(path)
    (loaded.processor or loaded.tokenizer).save_pretrained(path)
    return path
