"""Video clips in messages: `Video` (sampled frames and their rate), made from frames or decoded from a file.

A clip travels through the stack as its frames, already sampled: the env decides what the model sees, the
processor (`relax_gym.models.video_processor`) turns exactly those frames into model inputs, and the
trajectory keeps them. Bounds on frames and pixels per clip are checked where a clip is made.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

#: a clip's default bounds: frames, and pixels over all its frames (64 frames of 1024 x 1024)
MAX_FRAMES = 64
MAX_PIXELS = 64 * 1024 * 1024


@dataclass(frozen=True)
class Video:
    """A clip as the model sees it: its sampled frames (RGB, one size) and the rate they were sampled at."""

    frames: tuple[Image.Image, ...]
    fps: float

    @property
    def duration_s(self) -> float:
        return len(self.frames) / self.fps


class VideoError(ValueError):
    """A clip that cannot be used: no frames, frames of different sizes, too many frames or pixels, a file that
    does not decode. The message names the clip and the bound."""


def video_from_frames(frames: Sequence[Image.Image | np.ndarray], fps: float, *, max_frames: int = MAX_FRAMES,
                      max_pixels: int = MAX_PIXELS) -> Video:
    """A `Video` of `frames` (PIL images or HxWx3 uint8 arrays) shown `fps` per second, checked against the bounds:
    at most `max_frames` frames and `max_pixels` pixels in all (VideoError beyond them)."""
    if not frames:
        raise VideoError("a video needs at least one frame")
    if not (isinstance(fps, int | float) and math.isfinite(fps) and fps > 0):
        raise VideoError(f"a video's fps must be a positive number, got {fps!r}")
    if len(frames) > max_frames:
        raise VideoError(f"a video of {len(frames)} frames: at most {max_frames} (sample fewer frames, or raise "
                         "max_frames)")
    images = tuple(f.convert("RGB") if isinstance(f, Image.Image) else Image.fromarray(np.asarray(f, np.uint8))
                   .convert("RGB") for f in frames)
    sizes = {im.size for im in images}
    if len(sizes) != 1:
        raise VideoError(f"a video's frames must share one size, got {sorted(sizes)}")
    width, height = images[0].size
    if width < 1 or height < 1:
        raise VideoError(f"a video's frames have an empty size {images[0].size}")
    if width * height * len(images) > max_pixels:
        raise VideoError(f"a video of {len(images)} frames of {width}x{height} has {width * height * len(images)} "
                         f"pixels: at most {max_pixels}")
    return Video(images, float(fps))


def read_video(path: str | Path, *, fps: float = 2.0, max_frames: int = MAX_FRAMES,
               max_pixels: int = MAX_PIXELS) -> Video:
    """The frames of the video file `path` (decoded with PyAV), sampled at `fps` per second and at most
    `max_frames` evenly spaced over the clip; VideoError naming the file when it does not decode."""
    try:
        import av
    except ImportError as err:
        raise VideoError(f"{path}: decoding a video file needs PyAV (pip install av)") from err
    path = Path(path)
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            decoded = [(float(frame.time or 0.0), frame.to_image()) for frame in container.decode(stream)]
    except (av.FFmpegError, IndexError, OSError) as err:
        raise VideoError(f"{path}: cannot decode a video from it: {err}") from err
    if not decoded:
        raise VideoError(f"{path}: no video frames in it")
    duration = decoded[-1][0] + (decoded[-1][0] - decoded[0][0]) / max(len(decoded) - 1, 1)
    wanted = max(1, min(max_frames, round(duration * fps), len(decoded)))
    picks = np.linspace(0, len(decoded) - 1, wanted).round().astype(int)
    return video_from_frames([decoded[i][1] for i in picks], wanted / max(duration, 1e-9) if duration > 0 else fps,
                             max_frames=max_frames, max_pixels=max_pixels)
