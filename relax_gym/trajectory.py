"""The trajectory record: one episode, its exact tokens, and what training needs.

Field meanings are fixed by docs/architecture.md (the trajectory record). `segments` mark
which token ranges came from the prompt, the policy, or the environment, so a
viewer or a debugger can show turns without re-tokenizing anything. In JSONL,
images, audio and video frames are stored once as base64 PNG / WAV / PNGs in `media` (turn order);
the processor outputs in `mm_inputs` are tensors kept in memory only, since the
processor recomputes them from `media` deterministically.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np
from PIL import Image

from relax_gym.video import Video

Status = Literal["completed", "truncated", "aborted", "failed"]
SegmentKind = Literal["prompt", "policy", "env", "glue"]


@dataclass
class Segment:
    """Tokens [start, end) of one kind; `turn` counts policy turns (0 = before the first)."""

    kind: SegmentKind
    start: int
    end: int
    turn: int
    text: str = ""
    #: indices into `Trajectory.media` of the images / clips this segment brought in
    media: list[int] = field(default_factory=list)


@dataclass
class Trajectory:
    token_ids: list[int]
    prompt_len: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    versions: list[int]
    reward: float
    step_rewards: list[float]
    status: Status
    status_reason: str = ""
    group_id: str = ""
    env_id: str = ""
    task: str = ""
    segments: list[Segment] = field(default_factory=list)
    #: images (PIL), audio ((waveform, rate)) and videos (`Video`) in the order they entered the conversation
    media: list[Any] = field(default_factory=list)
    #: processor outputs for `media`, concatenated in turn order (tensors; not serialised)
    mm_inputs: dict[str, Any] = field(default_factory=dict)
    #: env infos, per-turn timings, tool counts, template-delta mismatches, ...
    metrics: dict[str, Any] = field(default_factory=dict)
    infos: list[dict[str, Any]] = field(default_factory=list)
    seed: int | None = None
    #: with routing replay (R3): the experts each MoE layer routed each token to in the engine's last forward,
    #: [tokens, layers, top_k] int16 for tokens 0..k (k < len(token_ids): the last token never ran); in JSONL
    #: as {"shape", "int16_b64"}
    routed_experts: np.ndarray | None = None

    def check(self) -> None:
        """Raises ValueError when the per-token fields disagree; cheap enough to run on every record."""
        n = len(self.token_ids)
        lengths = {k: len(getattr(self, k)) for k in ("loss_mask", "rollout_logprobs", "versions")}
        if any(v != n for v in lengths.values()):
            raise ValueError(f"per-token fields differ in length from token_ids ({n}): {lengths}")
        if any(m for m in self.loss_mask[: self.prompt_len]):
            raise ValueError("loss_mask has trained tokens inside the prompt")
        for i, (m, lp, v) in enumerate(zip(self.loss_mask, self.rollout_logprobs, self.versions, strict=True)):
            if m == 0 and (lp != 0.0 or v != -1):
                raise ValueError(f"token {i} is masked but has logprob {lp} / version {v} (expected 0.0 / -1)")
            if m == 1 and v < 0:
                raise ValueError(f"token {i} is trained but has no policy version")
        routes = self.routed_experts
        if routes is not None and (routes.ndim != 3 or routes.shape[0] >= max(n, 1)):
            raise ValueError(f"routed_experts of shape {routes.shape}: expected [tokens < {n}, layers, top_k]")

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def min_version(self) -> int | None:
        trained = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(trained) if trained else None

    # --- JSON -------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; it shares the trajectory's lists (no deep copy: a run writes every trajectory)."""
        out = {name: getattr(self, name) for name in _JSON_FIELDS}
        out["segments"] = [dict(vars(s)) for s in self.segments]
        out["media"] = [media_to_json(m) for m in self.media]
        if self.routed_experts is not None:
            out["routed_experts"] = routes_to_json(self.routed_experts)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trajectory:
        data = dict(data)
        data["segments"] = [Segment(**s) for s in data.get("segments", [])]
        data["media"] = [media_from_json(m) for m in data.get("media", [])]
        if data.get("routed_experts") is not None:
            data["routed_experts"] = routes_from_json(data["routed_experts"])
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


#: the fields `to_json` writes as they are (media and routes are encoded, segments flattened, processor outputs
#: left out)
_JSON_FIELDS = tuple(f.name for f in fields(Trajectory)
                     if f.name not in ("mm_inputs", "media", "segments", "routed_experts"))


def routes_to_json(routes: np.ndarray) -> dict[str, Any]:
    """Routed experts as their shape and their int16 bytes in base64 (a JSON list would be ~4x larger)."""
    return {"shape": list(routes.shape), "int16_b64": base64.b64encode(routes.astype("<i2").tobytes()).decode()}


def routes_from_json(item: dict[str, Any]) -> np.ndarray:
    """The [tokens, layers, top_k] array `routes_to_json` wrote."""
    flat = np.frombuffer(base64.b64decode(item["int16_b64"]), dtype="<i2")
    return flat.reshape(item["shape"]).astype(np.int16)


def media_to_json(item: Any, *, exact_audio: bool = False) -> dict[str, Any]:
    """One image (PNG), (waveform, rate) clip (16-bit WAV; 32-bit float with `exact_audio`) or video (a PNG per
    frame, and its fps) as a JSON-ready dict, base64 inside."""
    if isinstance(item, Image.Image):
        return {"type": "image", "png_b64": png_b64(item)}
    if isinstance(item, Video):
        return {"type": "video", "fps": item.fps, "frames_png_b64": [png_b64(f) for f in item.frames]}
    import soundfile

    buf = io.BytesIO()
    wave, rate = item
    soundfile.write(buf, np.asarray(wave, dtype=np.float32), int(rate), format="WAV",
                    subtype="FLOAT" if exact_audio else "PCM_16")
    return {"type": "audio", "wav_b64": base64.b64encode(buf.getvalue()).decode(), "sampling_rate": int(rate)}


def png_b64(image: Image.Image) -> str:
    """`image` as a PNG, in base64 (lossless: the frames a trajectory keeps are the ones the model saw)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def media_from_json(item: dict[str, Any]) -> Any:
    """The image, (waveform, rate) clip or video `media_to_json` wrote."""
    if item["type"] == "image":
        return _png(item["png_b64"])
    if item["type"] == "video":
        return Video(tuple(_png(f) for f in item["frames_png_b64"]), float(item["fps"]))
    import soundfile

    wave, rate = soundfile.read(io.BytesIO(base64.b64decode(item["wav_b64"])), dtype="float32")
    return wave, int(rate)


def _png(data: str) -> Image.Image:
    img = Image.open(io.BytesIO(base64.b64decode(data)))
    img.load()
    return img


def append_jsonl(f: TextIO, trajectories: Iterable[Trajectory], **fields: Any) -> int:
    """Writes one JSON line per trajectory to the open text file `f` in one write, then flushes, so a run that
    dies keeps every call's lines before (a training step's, a rollout group's); `fields` (e.g. a training step)
    go ahead of the record's own (`read_jsonl` ignores them).

    The one writer of trajectory JSONL (`relax-gym rollout`, a run's trajectories.jsonl, `write_jsonl`). Text
    is kept as UTF-8 rather than \\u escapes, unless it holds a lone surrogate, which UTF-8 cannot encode.
    """
    lines = []
    for traj in trajectories:
        record = {**fields, **traj.to_json()}
        line = json.dumps(record, ensure_ascii=False)
        if not line.isascii():
            try:
                line.encode("utf-8")
            except UnicodeEncodeError:
                line = json.dumps(record)
        lines.append(line + "\n")
    f.write("".join(lines))
    f.flush()
    return len(lines)


def write_jsonl(trajectories: Iterable[Trajectory], path: str | Path) -> int:
    """Writes `path` anew, one line per trajectory (`append_jsonl`)."""
    with Path(path).open("w", encoding="utf-8") as f:
        return append_jsonl(f, trajectories)


def read_jsonl(path: str | Path) -> Iterator[Trajectory]:
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield Trajectory.from_json(json.loads(line))
                except (ValueError, KeyError, TypeError) as err:
                    raise ValueError(f"{path}:{lineno}: not a trajectory record: {err}") from err
