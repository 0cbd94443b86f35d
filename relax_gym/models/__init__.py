"""Models for rollouts and training: the embedded tiny ones and local HF checkpoints.

`load_model("tiny" | "tiny-moe" | "tiny-vl" | "tiny-audio" | "tiny-omni" | folder)` gives a `LoadedModel`;
`render_ids` / `processor_inputs` turn chat messages into its exact inputs, and
`sequence_inputs` rebuilds them for a turn-by-turn appended trajectory.
"""

from relax_gym.models.chat_template import CHAT_TEMPLATE
from relax_gym.models.inputs import (
    MEDIA_KEYS,
    ChatTemplateError,
    chat_text,
    concat_media,
    encode,
    encode_media,
    processor_inputs,
    render_ids,
    sequence_inputs,
    template_messages,
)
from relax_gym.models.loading import (
    TINY_MODELS,
    LoadedModel,
    ModelLoadError,
    config_modalities,
    load_model,
    save_model,
)
from relax_gym.models.tiny import build_tiny_audio, build_tiny_moe, build_tiny_text, build_tiny_vl
from relax_gym.models.tokenizer import build_tokenizer
from relax_gym.models.video_processor import FramesVideoProcessor, frames_video

__all__ = [
    "CHAT_TEMPLATE",
    "MEDIA_KEYS",
    "TINY_MODELS",
    "ChatTemplateError",
    "FramesVideoProcessor",
    "LoadedModel",
    "ModelLoadError",
    "build_tiny_audio",
    "build_tiny_moe",
    "build_tiny_text",
    "build_tiny_vl",
    "build_tokenizer",
    "chat_text",
    "concat_media",
    "config_modalities",
    "encode",
    "encode_media",
    "frames_video",
    "load_model",
    "processor_inputs",
    "render_ids",
    "save_model",
    "sequence_inputs",
    "template_messages",
]
