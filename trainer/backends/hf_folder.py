"""Reading a checkpoint's weights back exactly from its Hugging Face model files.

Every `step_N/` folder is a model folder that `from_pretrained` loads: config,
generation config, weights as `save_pretrained` writes them, and the
tokenizer or processor with its chat template (`relax_gym.models.save_model`
writes them). Some models' saved names are
not their in-memory names (`save_pretrained` reverts Qwen2-Audio's
`model.audio_tower.*` to the original `audio_tower.*` layout), so resuming
reads the weights back through transformers' own loading path, which applies
the same key mapping forwards, instead of keeping a second, in-memory-named
copy of the weights: one copy on disk, bit-identical weights after resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from transformers import PreTrainedModel

from relax_gym.models.loading import quiet_progress


def load_hf_weights(model: PreTrainedModel, folder: Path) -> None:
    """Copies the weights saved in `folder` into `model` in place, under their in-memory names, exactly.

    transformers maps saved names to in-memory ones while it loads, so the
    weights go through `from_pretrained` into a CPU copy (in `model`'s dtype, so
    no value is cast) and from there into `model`. That costs one model's worth
    of CPU memory for the duration. A weight the folder lacks, or one it has
    that `model` does not, is an error rather than a silently initialised tensor.
    """
    with quiet_progress():
        # output_loading_info=True: the model and what loading it found (transformers types the model alone)
        saved, info = cast("tuple[PreTrainedModel, dict[str, list[Any]]]", type(model).from_pretrained(
            folder, dtype=model.dtype, local_files_only=True, output_loading_info=True))
    problems = {key: sorted(info[key])[:5] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")
                if info[key]}
    if problems:
        raise ValueError(f"{folder}: the saved weights do not fit the {type(model).__name__} being trained: {problems}")
    model.load_state_dict(saved.state_dict())
