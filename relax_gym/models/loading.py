"""`load_model`: one entry point for every name a user types for a model.

In order: a local HF checkpoint folder (or a run's checkpoint), one of `TINY_MODELS` (built in code), a GGUF
file or a folder holding one (`gguf_checkpoint`: dequantized to a plain model), then a hub id `ORG/NAME[@REV]`
(`hub`: a snapshot in the Hugging Face cache, fetched when online). Folders are read with
`local_files_only=True`: only the hub id path reaches the network, through huggingface_hub.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import transformers
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
from transformers.utils import logging as hf_logging

from relax_gym.errors import StartupError, first_line
from relax_gym.models.chat_template import BUNDLED_TEMPLATES
from relax_gym.models.gguf_checkpoint import GGUFError, gguf_file, load_gguf
from relax_gym.models.hub import HubModelError, hub_snapshot, parse_hub_id
from relax_gym.models.lora import LoraError, adapter_base, is_adapter_folder, merged_adapter
from relax_gym.models.tiny import (
    build_tiny_audio,
    build_tiny_moe,
    build_tiny_omni,
    build_tiny_text,
    build_tiny_vl,
)
from relax_gym.models.video_processor import frames_video

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model with what turns messages into its inputs; `processor` is None for text-only models."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    processor: ProcessorMixin | None
    modalities: tuple[str, ...]
    name: str
    #: keyword arguments every chat-template render gets (e.g. `enable_thinking: false`)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: how tool calls are read from this model's text: "auto" (from the tokenizer) or a format name
    tool_format: str = "auto"

    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end an assistant turn: the tokenizer's EOS, the generation config's, ChatML's turn ends.

        Real checkpoints list every turn end in `generation_config.json` (Llama 3.1: `<|eot_id|>`,
        `<|eom_id|>`; gpt-oss: `<|return|>`, `<|call|>`); ChatML's are added for folders without one.
        """
        tokenizer = self.tokenizer
        vocab = tokenizer.get_vocab()
        ids = {vocab[t] for t in CHATML_TURN_ENDS if t in vocab}
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        configured = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update([configured] if isinstance(configured, int) else configured or [])
        return frozenset(i for i in ids if isinstance(i, int))  # looked up in the vocab: never the unk id

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """The tokenizer's text for one sequence of ids (transformers types `decode` for a batch as well)."""
        return cast(str, self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: the vocabulary's longest token in symbols (a byte-level or
        sentencepiece symbol covers at most one character). A text longer than N x this cannot fit in N tokens,
        which a server or a rollout can tell before spending the tokenizer's time and memory on it."""
        tokenizer = self.tokenizer
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        return max(1, max((len(t) for t in tokens if t), default=1))


TINY_MODELS: tuple[str, ...] = ("tiny", "tiny-moe", "tiny-vl", "tiny-audio", "tiny-omni")
CHATML_TURN_ENDS: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")


def _build_tiny(name: str) -> LoadedModel:
    if name in ("tiny", "tiny-moe"):
        model, tokenizer = (build_tiny_text if name == "tiny" else build_tiny_moe)()
        return LoadedModel(model, tokenizer, None, ("text",), name)
    build = {"tiny-vl": build_tiny_vl, "tiny-audio": build_tiny_audio, "tiny-omni": build_tiny_omni}[name]
    multimodal, processor = build()
    return LoadedModel(multimodal, processor.tokenizer, processor, config_modalities(multimodal.config), name)


def config_modalities(config: PretrainedConfig) -> tuple[str, ...]:
    """Which input modalities a checkpoint takes, read from its sub-configs (video: a vision tower with a video
    placeholder token, as the Qwen-VL and Qwen-Omni models have)."""
    found = ["text"]
    if getattr(config, "vision_config", None) is not None:
        found.append("image")
    if getattr(config, "audio_config", None) is not None:
        found.append("audio")
    if "image" in found and getattr(config, "video_token_id", None) is not None:
        found.append("video")
    return tuple(found)


class ModelLoadError(StartupError):
    """A model name or folder that cannot be loaded; the message says which and why."""


def _not_found(name_or_path: str, why: str) -> ModelLoadError:
    return ModelLoadError(
        f"model {name_or_path!r}: {why}. Pass a local Hugging Face checkpoint folder (config.json, "
        "tokenizer or processor files, *.safetensors), a .gguf file, a hub id (ORG/NAME[@REVISION]) or an "
        f"embedded tiny model: {', '.join(TINY_MODELS)}."
    )


def _is_checkpoint(path: Path) -> bool:
    """A model folder: a transformers one (config.json) or a PEFT adapter folder (loaded merged into its base)."""
    return (path / "config.json").is_file() or is_adapter_folder(path)


def resolve_checkpoint(name_or_path: str) -> str:
    """The step folder that a training run's `latest` pointer names, so a run's checkpoint loads as a model.

    `RUN/checkpoints/latest` (the pointer file), `RUN/checkpoints` and `RUN`
    resolve to `RUN/checkpoints/step_N`; anything else (a tiny model's name, a
    model folder with its config.json) is returned unchanged. A pointer that
    does not name an existing step is a `ModelLoadError` naming the file.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir() and not _is_checkpoint(path):
        pointer = next((p for p in (path / "latest", path / "checkpoints" / "latest") if p.is_file()), None)
        if pointer is None:
            return name_or_path
    elif path.name == "latest" and path.is_file():
        pointer = path
    else:
        return name_or_path
    try:
        number = read_pointer(pointer)
    except OSError as err:
        raise ModelLoadError(f"checkpoint pointer {pointer}: cannot read it: {err.strerror or err}") from None
    if isinstance(number, str):
        raise ModelLoadError(f"checkpoint pointer {pointer} holds {number[:40]!r}, not a step number")
    step = pointer.parent / f"step_{number}"
    if not step.is_dir():
        raise ModelLoadError(f"checkpoint pointer {pointer} names step {number}, but {step} is missing")
    return str(step)


def read_pointer(pointer: Path) -> int | str:
    """The step number a run's `latest` file holds, or its text when that is not a number (callers decide)."""
    text = pointer.read_text(errors="replace").strip()
    return int(text) if text.isdigit() else text


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    chat_template: str | Path | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    tool_format: str = "auto",
) -> LoadedModel:
    """A tiny model by name, else a local checkpoint folder; `dtype=None` keeps fp32 / the saved dtype.

    A checkpoint folder whose name is also a tiny model's (`./tiny-vl`) wins: the
    user who has one there means it. Any failure to read a folder is a
    `ModelLoadError` naming the folder and the cause. `chat_template` (a Jinja
    file) replaces the checkpoint's template; `template_kwargs` reach every render;
    `tool_format` names how tool calls are read from the model's text. A training
    run's checkpoint pointer loads the step it names (`resolve_checkpoint`).
    """
    name_or_path = resolve_checkpoint(name_or_path)
    loaded = _load(name_or_path, dtype, device)
    if chat_template is not None:
        use_chat_template(loaded, chat_template)
    loaded.template_kwargs = dict(template_kwargs or {})
    loaded.tool_format = tool_format
    return loaded


def use_chat_template(loaded: LoadedModel, path: str | Path) -> None:
    """Replaces the tokenizer's (and processor's) chat template with the Jinja file at `path`, or with the
    bundled template of that name (`BUNDLED_TEMPLATES`, unless a file of that name is here)."""
    if str(path) in BUNDLED_TEMPLATES and not Path(path).is_file():
        template = BUNDLED_TEMPLATES[str(path)]
    else:
        path = Path(path).expanduser()
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ModelLoadError(f"chat template {path}: cannot read it: {type(err).__name__}: "
                                 f"{first_line(err)} (bundled templates, by name: "
                                 f"{', '.join(BUNDLED_TEMPLATES)})") from None
    if not template.strip():
        raise ModelLoadError(f"chat template {path}: the file is empty")
    loaded.tokenizer.chat_template = template
    if loaded.processor is not None:
        loaded.processor.chat_template = template


def _load(name_or_path: str, dtype: torch.dtype | None, device: str | torch.device) -> LoadedModel:
    path = Path(name_or_path).expanduser()
    if name_or_path in TINY_MODELS and not _is_checkpoint(path):
        loaded = _build_tiny(name_or_path)
        loaded.model.to(device=device, dtype=dtype)  # type: ignore[call-arg]  # transformers' @wraps-typed `to`
        return loaded
    if name_or_path in TINY_MODELS:
        log.warning("model %r: using the checkpoint folder %s, not the embedded tiny model of that name",
                    name_or_path, path.resolve())
    try:
        gguf = gguf_file(path)
    except GGUFError as err:
        raise ModelLoadError(f"model {name_or_path!r}: {err}") from None
    if gguf is not None:
        return _load_gguf(gguf, dtype, device)
    if not path.exists() and parse_hub_id(name_or_path) is not None:
        path = _hub_folder(name_or_path, path)
    elif not path.is_dir():
        raise _not_found(name_or_path, f"no folder at {path}")
    if not _is_checkpoint(path):
        raise _not_found(name_or_path, f"the folder {path} has no config.json")
    if is_adapter_folder(path):
        return _load_adapter(path, dtype, device)
    try:
        with quiet_progress():
            return _load_folder(path, dtype, device)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError, SafetensorError) as err:
        # transformers reports a bad folder in many types (empty config: ValueError, no weights: OSError,
        # a truncated safetensors file: SafetensorError, a RuntimeError); the user needs one line
        raise ModelLoadError(f"model folder {path}: cannot load it: {type(err).__name__}: {first_line(err)}") from err


def _load_adapter(path: Path, dtype: torch.dtype | None, device: str | torch.device) -> LoadedModel:
    """A PEFT adapter folder as a plain model: the base it names, loaded, with the adapter merged into it, and the
    folder's own tokenizer (its chat template) where it has one."""
    try:
        base_name = adapter_base(path)
        base = _load(base_name, dtype, device)
        model = merged_adapter(base.model, path)
    except (LoraError, OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"adapter folder {path}: {first_line(err)}") from None
    except ModelLoadError as err:
        raise ModelLoadError(f"adapter folder {path}: its base {base_name!r} cannot be loaded: {err}") from None
    tokenizer, processor = base.tokenizer, base.processor
    if any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        with quiet_progress():
            if processor is not None:
                processor = type(processor).from_pretrained(path, local_files_only=True)
                tokenizer = processor.tokenizer
            else:
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(model, tokenizer, processor, base.modalities, str(path))


def _hub_folder(name: str, path: Path) -> Path:
    """The snapshot folder of the hub id `name`. A name whose parent folder exists here is as likely a
    mistyped path: the error then says that first."""
    try:
        return hub_snapshot(name)
    except HubModelError as err:
        typo = path.parent != Path(".") and path.parent.is_dir()
        raise ModelLoadError(f"model {name!r}: {f'no folder at {path}, and as ' if typo else ''}a hub id, "
                             f"{err}") from None


def _load_gguf(file: Path, dtype: torch.dtype | None, device: str | torch.device) -> LoadedModel:
    try:
        with quiet_progress():
            model, tokenizer = load_gguf(file, dtype)
    except GGUFError as err:
        raise ModelLoadError(f"model {err}") from err
    log.warning("model %s: a dequantized start (GGUF weights as %s): its logprobs differ from the quantized "
                "model's by the quantization error; checkpoints save the dequantized weights", file,
                str(next(model.parameters()).dtype).removeprefix("torch."))
    model = model.to(device)  # type: ignore[arg-type]  # transformers' @wraps-typed `to`
    return LoadedModel(model, tokenizer, None, ("text",), str(file))


@contextmanager
def quiet_progress() -> Iterator[None]:
    """No per-shard progress bars: loading or saving a model (every checkpoint) would fill a run's one screen."""
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


#: a folder needs one of these for its tokenizer: without any, AutoTokenizer makes an empty one and says nothing
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer.model", "vocab.json", "*.tiktoken")


def _load_folder(path: Path, dtype: torch.dtype | None, device: str | torch.device) -> LoadedModel:
    if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}): save the tokenizer beside the model, "
                         "or copy its files from the checkpoint it came from")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    modalities = config_modalities(config)
    auto_model = AutoModelForCausalLM if modalities == ("text",) else AutoModelForMultimodalLM
    model = auto_model.from_pretrained(path, local_files_only=True, dtype=dtype or "auto").to(device)  # type: ignore[arg-type]
    if modalities == ("text",):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return LoadedModel(model, tokenizer, None, modalities, str(path))
    processor_cls = _processor_class(config, path)
    # the video part is always `FramesVideoProcessor` (the stock one needs torchvision; it gives the same inputs)
    processor_cls = frames_video(processor_cls)  # type: ignore[arg-type]  # a class is Hashable; mypy disagrees
    processor = processor_cls.from_pretrained(path, local_files_only=True)
    return LoadedModel(model, processor.tokenizer, processor, modalities, str(path))


def _processor_class(config: PretrainedConfig, path: Path) -> type[ProcessorMixin]:
    """The processor class of a multimodal folder: transformers' for its config, else the one its
    processor_config.json names (a Qwen-Omni thinker's config maps to none)."""
    if type(config) in PROCESSOR_MAPPING:
        return cast("type[ProcessorMixin]", PROCESSOR_MAPPING[type(config)])  # typed as the tokenizers' pairs
    saved = path / "processor_config.json"
    name = json.loads(saved.read_text(encoding="utf-8")).get("processor_class") if saved.is_file() else None
    found = getattr(transformers, str(name), None) if name else None
    if not (isinstance(found, type) and issubclass(found, ProcessorMixin)):
        raise ValueError(f"no processor class for a {type(config).__name__} (processor_config.json names {name!r})")
    return found


def save_model(loaded: LoadedModel, path: str | Path) -> Path:
    """Writes a folder `load_model` reads: safetensors, config, tokenizer / processor, chat template."""
    path = Path(path)
    save_pretrained_folder(path, loaded.model, loaded.processor or loaded.tokenizer)
    return path


def save_pretrained_folder(folder: Path, model: PreTrainedModel, files: Any | None,
                           state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """`model.save_pretrained(folder)` (with `state_dict` as its weights when given) and `files.save_pretrained`.

    `files` is the tokenizer, or the processor of a VL / audio model (which saves
    its tokenizer and chat template too); None writes the model alone.
    """
    with quiet_progress():
        model.save_pretrained(folder, state_dict=state_dict)
        if files is not None:
            files.save_pretrained(folder)
