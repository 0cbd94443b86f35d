"""Chat messages and env infos as JSON, for envs served over HTTP (`relax-gym env-server`, `RemoteEnv`).

Text parts travel as they are; images, audio clips and videos as the trajectory JSONL stores them
(`media_to_json`: PNG, PNG frames with their fps), audio as 32-bit float WAV rather than the JSONL's 16-bit,
so a served env's observation reaches the model exactly as the in-process env's would. Infos are plain JSON: numpy
scalars and arrays become numbers and lists, anything else its `repr`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from relax_gym.messages import Message, validate_messages
from relax_gym.trajectory import media_from_json, media_to_json
from relax_gym.video import Video

#: part types whose value is a medium, held under the part's type as key (audio also has its sampling_rate)
_MEDIA = frozenset({"image", "audio", "video"})


def messages_to_json(messages: list[Message]) -> list[dict[str, Any]]:
    """`messages` with every media part encoded (a new list; the messages are not changed)."""
    out = []
    for msg in messages:
        content = []
        for part in msg["content"]:
            item: dict[str, Any] = dict(part)  # the part's keys as its type has them
            kind = item["type"]
            if kind == "audio":
                media = media_to_json((item["audio"], item["sampling_rate"]), exact_audio=True)
                content.append({"type": "audio", "media": media})
            elif kind in _MEDIA:
                content.append({"type": kind, "media": media_to_json(item[kind])})
            else:
                content.append(item)
        out.append({**msg, "content": content})
    return out


def messages_from_json(data: Any) -> list[Message]:
    """The messages `messages_to_json` wrote, checked (`MessageError` on a malformed one)."""
    if not isinstance(data, list):
        raise ValueError(f"expected a list of messages, got {type(data).__name__}")
    out: list[Any] = []
    for msg in data:
        content = []
        for part in msg.get("content", []) if isinstance(msg, dict) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _MEDIA and "media" in part:
                value = media_from_json(part["media"])
                if kind == "audio":
                    wave, rate = value
                    content.append({"type": "audio", "audio": np.asarray(wave, np.float32), "sampling_rate": rate})
                else:
                    content.append({"type": kind, kind: value})
            else:
                content.append(part)
        out.append({**msg, "content": content} if isinstance(msg, dict) else msg)
    validate_messages(out)
    return out


def plain(value: Any) -> Any:
    """`value` as plain JSON data: numpy scalars and arrays as numbers and lists, tuples as lists, other objects
    (a PIL image, a `Video`) as their repr."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, Video):
        return f"<video: {len(value.frames)} frames at {value.fps:g} fps>"
    return repr(value)
