"""Messages → chat text → model inputs, the one path rollouts and trainers share.

Token ids always come from the processor when there is one, so image and audio
placeholders are already expanded to the number of embeddings the model
splices in; the same call returns the pixel / audio features those positions
need to recompute logprobs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import jinja2
import numpy as np
import torch
from transformers import BatchFeature

from relax_gym.messages import Message
from relax_gym.models.loading import LoadedModel


class ChatTemplateError(ValueError):
    """The chat template raised while rendering (its message says why)."""


# Per-media features that stack along dim 0 across turns, in the order the media appear.
MEDIA_KEYS: tuple[str, ...] = ("pixel_values", "image_grid_thw", "input_features", "feature_attention_mask")


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
    return encode_media(loaded, text, images, audios)


def encode_media(
    loaded: LoadedModel,
    text: str,
    images: Sequence[Any] = (),
    audios: Sequence[tuple[np.ndarray, int]] = (),
) -> BatchFeature:
    """Tokenizes `text` with its placeholders expanded for `images` and `audios` (waveform, rate), in order."""
    if loaded.processor is None:
        if images or audios:
            raise ValueError(f"model {loaded.name!r} takes text only, not images or audio")
        return BatchFeature(dict(loaded.tokenizer([text], add_special_tokens=False, return_tensors="pt")))
    kwargs: dict[str, Any] = {}
    if images:
        kwargs["images"] = list(images)
    if audios:
        rate = loaded.processor.feature_extractor.sampling_rate
        kwargs["audio"] = [_resample(np.asarray(w, dtype=np.float32), sr, rate) for w, sr in audios]
        kwargs["sampling_rate"] = rate
    return loaded.processor(text=[text], add_special_tokens=False, return_tensors="pt", **kwargs)


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
            inputs[key] = torch.cat(chunks)
    if "image_grid_thw" in inputs:
        processor: Any = loaded.processor  # a VL processor made the grid; it names the image placeholder's id
        inputs["mm_token_type_ids"] = (ids == processor.image_token_id).long()
    return BatchFeature(inputs)
