"""Messages → chat text → model inputs, the one path rollouts and trainers share.

Token ids always come from the processor when there is one, so image and audio
placeholders are already expanded to the number of embeddings the model
splices in; the same call returns the pixel / audio features those positions
need to recompute logprobs.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, cast

import jinja2
import numpy as np
import torch
from transformers import BatchFeature
from transformers.video_utils import VideoMetadata

from relax_gym.messages import Message
from relax_gym.models.loading import LoadedModel
from relax_gym.video import Video


class ChatTemplateError(ValueError):
    """The chat template raised while rendering (its message says why)."""


# Per-media features that stack along dim 0 across turns, in the order the media appear.
MEDIA_KEYS: tuple[str, ...] = ("pixel_values", "image_grid_thw", "input_features", "feature_attention_mask",
                               "pixel_values_videos", "video_grid_thw", "video_second_per_grid")


#: media features whose last dimension is time: a processor pads one call's clips to the longest (the Omni
#: processors do), so clips from different calls differ there and are padded to concatenate (with mask 0)
_TIME_LAST_KEYS = frozenset({"input_features", "feature_attention_mask"})


def concat_media(key: str, chunks: Sequence[Any]) -> torch.Tensor:
    """One `MEDIA_KEYS` feature of several turns, samples or requests, concatenated in order along dim 0 (audio
    features right-padded in time to the longest; the models read each clip's length from its mask)."""
    tensors = [torch.as_tensor(c) for c in chunks]
    if key in _TIME_LAST_KEYS and len({t.shape[-1] for t in tensors}) > 1:
        width = max(t.shape[-1] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in tensors]
    return torch.cat(tensors)


def template_messages(loaded: LoadedModel, messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as `loaded`'s template takes them; the one place content is flattened.

    Text-only checkpoints' templates (Qwen3's among them) expect string content,
    so their messages get their text parts joined; a media part sent to a model
    that cannot take it is an error rather than silently dropped.
    """
    if loaded.modalities != ("text",):
        return cast("list[dict[str, Any]]", list(messages))  # a Message is a dict
    flat: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        content: Any = msg.get("content")
        if isinstance(content, list):
            media = sorted({p["type"] for p in content if p["type"] != "text"})
            if media:
                raise ValueError(
                    f"messages[{i}] has {'/'.join(media)} parts but {loaded.name!r} takes text only"
                )
            content = "".join(p["text"] for p in content)
        flat.append({**msg, "content": content})
    return flat


def chat_text(
    loaded: LoadedModel,
    messages: list[Message],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The conversation rendered by the model's chat template (the processor's, if it has one).

    A template that refuses the conversation (`raise_exception`, as Mistral's does
    when roles do not alternate) raises `ChatTemplateError`, a ValueError.
    """
    template = loaded.processor.chat_template if loaded.processor is not None else None
    if isinstance(template, dict):  # several named templates: the default one, as the processor's own render picks
        if "default" not in template:
            raise ChatTemplateError(f"{loaded.name!r}: no 'default' among the processor's templates {sorted(template)}")
        template = template["default"]
    try:
        return cast(str, loaded.tokenizer.apply_chat_template(  # tokenize=False: the text (typed for all modes)
            template_messages(loaded, messages),
            tools=None if tools is None else [*tools],
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **loaded.template_kwargs,
        ))
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"the chat template of {loaded.name} refused the conversation: "
                                f"{type(err).__name__}: {err}") from None


def _resample(wave: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Anti-aliased (triangle filter) resampling; no audio library is assumed to be installed."""
    if rate == target:
        return wave
    size = max(1, round(len(wave) * target / rate))
    x = torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32)).view(1, 1, 1, -1)
    out = torch.nn.functional.interpolate(
        x, size=(1, size), mode="bilinear", antialias=True, align_corners=False
    )
    return out.view(-1).numpy()


def at_model_rate(loaded: LoadedModel, audios: Sequence[tuple[np.ndarray, int]]) -> list[tuple[np.ndarray, int]]:
    """`audios` (waveform, rate) resampled as `encode_media` resamples them for the model's processor.

    Engine requests carry these, so a server that decodes the clips again sees the very samples the trainer's
    features come from: SGLang resamples a clip at another rate with its own filter (torchcodec or torchaudio),
    not this one, and at the model's rate leaves it as it is."""
    if loaded.processor is None or not audios:
        return list(audios)
    rate = loaded.processor.feature_extractor.sampling_rate
    return [(_resample(np.asarray(w, dtype=np.float32), sr, rate), rate) for w, sr in audios]


def processor_inputs(
    loaded: LoadedModel,
    messages: list[Message],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> BatchFeature:
    """Batch-of-one inputs for `messages`, to pass whole to `model(...)` or `model.generate(...)`.

    input_ids and attention_mask, plus the features of the media in `messages`, in order:
    pixel_values / image_grid_thw / mm_token_type_ids (VL) or input_features /
    feature_attention_mask (audio).
    """
    text = chat_text(loaded, messages, tools=tools, add_generation_prompt=add_generation_prompt)
    return encode(loaded, text, messages)


def encode(loaded: LoadedModel, text: str, messages: list[Message]) -> BatchFeature:
    """Tokenizes rendered `text` whose media placeholders belong to the parts of `messages`.

    The rollout manager encodes one turn's template delta at a time with this,
    so each image or clip goes through the processor once.
    """
    parts = [p for msg in messages if isinstance(msg.get("content"), list) for p in msg["content"]]
    images = [p["image"] for p in parts if p["type"] == "image"]
    audios = [(p["audio"], p["sampling_rate"]) for p in parts if p["type"] == "audio"]
    videos = [p["video"] for p in parts if p["type"] == "video"]
    return encode_media(loaded, text, images, audios, videos)


def encode_media(
    loaded: LoadedModel,
    text: str,
    images: Sequence[Any] = (),
    audios: Sequence[tuple[np.ndarray, int]] = (),
    videos: Sequence[Video] = (),
) -> BatchFeature:
    """Tokenizes `text` with its placeholders expanded for `images`, `audios` (waveform, rate) and `videos`, each
    in order. A video's frames go to the processor as they are, with their rate (Qwen3-VL writes each frame
    group's timestamp into the text from it; the Omni models space the groups' positions by it)."""
    if loaded.processor is None:
        if images or audios or videos:
            raise ValueError(f"model {loaded.name!r} takes text only, not images, audio or video")
        return BatchFeature(dict(loaded.tokenizer([text], add_special_tokens=False, return_tensors="pt")))
    kwargs: dict[str, Any] = {}
    if images:
        kwargs["images"] = list(images)
    if audios:
        rate = loaded.processor.feature_extractor.sampling_rate
        kwargs["audio"] = [_resample(np.asarray(w, dtype=np.float32), sr, rate) for w, sr in audios]
        kwargs["sampling_rate"] = rate
    if videos:
        if getattr(loaded.processor, "video_processor", None) is None:
            raise ValueError(f"model {loaded.name!r} takes no video")
        rates = {v.fps for v in videos}
        if len(rates) > 1:  # the Omni processors take one rate per call
            raise ValueError(f"the videos of one turn must share one fps, got {sorted(rates)}")
        # the frames as they are (no sampling) and their rate: what any Qwen-VL video processor takes
        kwargs["videos"] = [list(v.frames) for v in videos]
        kwargs["video_metadata"] = [VideoMetadata(total_num_frames=len(v.frames), fps=v.fps,
                                                  frames_indices=list(range(len(v.frames)))) for v in videos]
        kwargs["fps"] = rates.pop()
        kwargs["do_sample_frames"] = False
        kwargs["return_metadata"] = True  # Qwen3-VL's timestamps come from it
    out = loaded.processor(text=[text], add_special_tokens=False, return_tensors="pt", **kwargs)
    if "video_second_per_grid" in out:  # a list of floats, one per video: a tensor, to concatenate across turns
        out["video_second_per_grid"] = torch.as_tensor(out["video_second_per_grid"], dtype=torch.float32)
    out.pop("video_metadata", None)
    return out


def render_ids(
    loaded: LoadedModel,
    messages: list[Message],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The token ids the model sees for `messages`, media placeholders expanded."""
    inputs = processor_inputs(loaded, messages, tools=tools, add_generation_prompt=add_generation_prompt)
    return inputs["input_ids"][0].tolist()


def sequence_inputs(
    loaded: LoadedModel, token_ids: Sequence[int] | torch.Tensor, mm_inputs: Sequence[Mapping[str, Any]] = ()
) -> BatchFeature:
    """Inputs for a sequence built by appending turns rather than by one render, as trajectories are.

    `mm_inputs` holds each turn's `processor_inputs` (or just its `MEDIA_KEYS`) in turn order. M-RoPE
    models (Qwen-VL) also need `mm_token_type_ids`, which marks the image placeholder positions.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).view(1, -1)
    inputs: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    for key in MEDIA_KEYS:
        if chunks := [m[key] for m in mm_inputs if key in m]:
            inputs[key] = concat_media(key, chunks)
    if ("image_grid_thw" in inputs or "video_grid_thw" in inputs) and takes_token_types(loaded.model):
        # a VL processor made the grid and names the placeholders (as its `create_mm_token_type_ids`: 1 image, 2 video)
        processor: Any = loaded.processor
        types = (ids == processor.image_token_id).long()
        if getattr(processor, "video_token_id", None) is not None:
            types += 2 * (ids == processor.video_token_id).long()
        inputs["mm_token_type_ids"] = types
    return BatchFeature(inputs)


@functools.cache
def _takes_token_types(model_class: Any) -> bool:
    return "mm_token_type_ids" in inspect.signature(model_class.forward).parameters


def takes_token_types(model: Any) -> bool:
    """Whether the model's forward reads `mm_token_type_ids` (Qwen3-VL does; the Omni thinkers find their media
    tokens by id). Read once per model class."""
    model_class: Any = type(model)  # a class is hashable; mypy's `type` is not `Hashable`
    return bool(_takes_token_types(model_class))
