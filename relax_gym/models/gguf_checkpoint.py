"""A GGUF file (llama.cpp's format) as a plain fp32 transformers model and its tokenizer.

transformers reads GGUF itself (through the `gguf` package): it dequantizes every tensor and builds the
tokenizer, with the file's chat template, from the file's metadata. What it returns is marked quantized, so it
refuses `save_pretrained`, which every checkpoint needs; the model is therefore rebuilt from its config
without the quantization entry and given the same weights. Training starts from the dequantized weights, not
the quantized model: its logprobs differ from llama.cpp's by the quantization error.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from relax_gym.errors import first_line

#: what installs the reader transformers needs for GGUF (`gguf`, and `accelerate` for its loading path)
GGUF_EXTRA = "pip install 'relax-gym[gguf]'"


class GGUFError(ValueError):
    """A GGUF path that does not load; the message names the file and the cause."""


def gguf_file(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `*.gguf` of a folder with no config.json;
    None when it names none. A folder with several is a `GGUFError` listing them."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        raise GGUFError(f"the folder {path} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}): "
                        "pass the one to load")
    return found[0] if found else None


def load_gguf(file: Path, dtype: torch.dtype | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model in `file`, dequantized into a plain (saveable) model in `dtype` (default fp32), and its
    tokenizer. Raises `GGUFError` naming the file for a missing reader, an architecture transformers does
    not read, or a file that is not valid GGUF."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise GGUFError(f"{file}: reading GGUF needs the {' and '.join(missing)} package(s): {GGUF_EXTRA}")
    try:
        quantized = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True,
                                                         dtype=dtype or torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
    except Exception as err:  # the gguf reader and transformers fail in many types (struct, Value, Key, OSError...)
        raise GGUFError(f"{file}: cannot load it as GGUF: {type(err).__name__}: {first_line(err)}") from err
    return dequantized(quantized), tokenizer


def dequantized(model: PreTrainedModel) -> PreTrainedModel:
    """`model` (loaded from GGUF, its weights already dequantized) as a model of the same class whose config
    names no quantization, so that it saves and reloads as a plain checkpoint."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain.to(next(model.parameters()).dtype).eval()  # type: ignore[arg-type]  # @wraps-typed `to`
