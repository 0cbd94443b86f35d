"""Chat messages with text, image, audio and video parts.

Messages are plain dicts in the shape Hugging Face chat templates and processors
already take (`{"role": ..., "content": [{"type": "text", "text": ...}, ...]}`),
so an environment's output reaches `apply_chat_template` without translation.
Content is always a list of parts here; `text_content` flattens it for
text-only templates that expect a string.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

import numpy as np
from PIL import Image

from relax_gym.video import Video, video_from_frames

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
PART_TYPES: tuple[str, ...] = ("text", "image", "audio", "video")


class TextPart(TypedDict):
    type: Literal["text"]
    text: str


class ImagePart(TypedDict):
    type: Literal["image"]
    image: Image.Image


class AudioPart(TypedDict):
    type: Literal["audio"]
    audio: np.ndarray
    sampling_rate: int


class VideoPart(TypedDict):
    type: Literal["video"]
    video: Video


Part = TextPart | ImagePart | AudioPart | VideoPart


class Message(TypedDict):
    role: Role
    content: list[Part]
    name: NotRequired[str]
    tool_call_id: NotRequired[str]
    tool_calls: NotRequired[list[dict[str, Any]]]


class MessageError(ValueError):
    """A message or part does not have the shape the rollout manager relies on."""


def text(value: str) -> TextPart:
    return {"type": "text", "text": value}


def image(value: Image.Image) -> ImagePart:
    return {"type": "image", "image": value}


def audio(waveform: np.ndarray, sampling_rate: int) -> AudioPart:
    """A mono float waveform; processors resample from `sampling_rate` themselves."""
    return {"type": "audio", "audio": np.asarray(waveform, dtype=np.float32), "sampling_rate": int(sampling_rate)}


def video(clip: Video | list[Image.Image] | list[np.ndarray], fps: float | None = None) -> VideoPart:
    """A clip: a `Video` (`relax_gym.models.video.read_video` decodes a file into one), or its frames (PIL
    images or HxWx3 uint8 arrays) with the `fps` they were sampled at, checked against `video_from_frames`'
    bounds on frames and pixels."""
    if not isinstance(clip, Video):
        if fps is None:
            raise MessageError("video(frames, fps): the frames' rate is needed (their timestamps come from it)")
        clip = video_from_frames(clip, fps)
    return {"type": "video", "video": clip}


def message(role: Role, *parts: Part | str, **extra: Any) -> Message:
    """Builds a message; bare strings become text parts."""
    content = [text(p) if isinstance(p, str) else p for p in parts]
    msg: dict[str, Any] = {"role": role, "content": content, **extra}
    validate_message(msg)
    return msg  # type: ignore[return-value]


def system(*parts: Part | str) -> Message:
    return message("system", *parts)


def user(*parts: Part | str) -> Message:
    return message("user", *parts)


def assistant(*parts: Part | str) -> Message:
    return message("assistant", *parts)


def tool_message(*parts: Part | str, name: str) -> Message:
    """A `tool` role message: the result of the tool `name` (`relax_gym.tools.tool` is the decorator)."""
    return message("tool", *parts, name=name)


def validate_part(part: Any, where: str = "part") -> None:
    """Raises MessageError naming the first thing wrong with `part`."""
    if not isinstance(part, dict):
        raise MessageError(f"{where}: expected a dict content part, got {type(part).__name__}")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise MessageError(f"{where}: text part needs a str 'text'")
    elif kind == "image":
        if not isinstance(part.get("image"), Image.Image):
            raise MessageError(f"{where}: image part needs a PIL.Image 'image', got {type(part.get('image')).__name__}")
        width, height = part["image"].size
        if width < 1 or height < 1:
            raise MessageError(f"{where}: image has an empty size {part['image'].size}")
    elif kind == "audio":
        wave = part.get("audio")
        if not isinstance(wave, np.ndarray) or wave.ndim != 1 or not np.issubdtype(wave.dtype, np.floating):
            raise MessageError(f"{where}: audio part needs a 1-D float numpy waveform in 'audio'")
        if wave.size == 0 or not np.all(np.isfinite(wave)):
            raise MessageError(f"{where}: audio waveform is empty or has non-finite samples")
        rate = part.get("sampling_rate")
        if not isinstance(rate, int | np.integer) or rate <= 0:
            raise MessageError(f"{where}: audio part needs a positive int 'sampling_rate', got {rate!r}")
    elif kind == "video":
        if not isinstance(part.get("video"), Video):
            raise MessageError(f"{where}: video part needs a relax_gym Video in 'video' (messages.video(frames, "
                               f"fps) makes one), got {type(part.get('video')).__name__}")
    else:
        raise MessageError(f"{where}: unknown part type {kind!r}; expected one of {PART_TYPES}")


def validate_message(msg: Any, where: str = "message") -> None:
    if not isinstance(msg, dict):
        raise MessageError(f"{where}: expected a dict, got {type(msg).__name__}")
    if msg.get("role") not in ROLES:
        raise MessageError(f"{where}: role {msg.get('role')!r} is not one of {ROLES}")
    content = msg.get("content")
    if not isinstance(content, list):
        raise MessageError(f"{where}: content must be a list of parts, got {type(content).__name__}")
    for i, part in enumerate(content):
        validate_part(part, f"{where}.content[{i}]")


def validate_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise MessageError(f"expected a list of messages, got {type(messages).__name__}")
    for i, msg in enumerate(messages):
        validate_message(msg, f"messages[{i}]")


def text_content(msg: Message) -> str:
    """The message's text parts joined, for templates that take a plain string."""
    return "".join(p["text"] for p in msg["content"] if p["type"] == "text")


def modalities(messages: list[Message]) -> set[str]:
    return {part["type"] for msg in messages for part in msg["content"]}
