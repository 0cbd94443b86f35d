"""Video clips in messages: `Video` (sampled frames and their rate), made from frames or decoded from a file.

A clip travels through the stack as its frames, already sampled: the env decides what the model sees, the
processor (`relax_gym.models.video_processor`) turns exactly those frames into model inputs, and the
trajectory keeps them. Bounds on frames and pixels per clip are checked where a clip is made.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

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


def read_video(source: str | Path | bytes, *, fps: float | None = 2.0, max_frames: int = MAX_FRAMES,
               max_pixels: int = MAX_PIXELS, codecs: frozenset[str] | None = None,
               frame_pixels: int | None = None, before_frame: Callable[[int], None] | None = None) -> Video:
    """The frames of a video file (a path, or its bytes), decoded with PyAV: sampled at `fps` per second, at
    most `max_frames` evenly spaced over the clip, or with `fps=None` every frame at the file's own rate (more
    than `max_frames` is then an error). `codecs` (None: any) allows only those decoders, and a frame of more
    than `frame_pixels` (default `max_pixels`) is refused from the stream's header, before a frame is decoded.
    `before_frame(bytes)` is told each frame's RGB size before it is converted, and may raise to stop the decode.
    VideoError names the source when it does not decode."""
    av = _pyav()
    name = f"{len(source)} bytes of video" if isinstance(source, bytes) else str(source)
    decoded: list[tuple[float, Image.Image]] = []
    try:
        with av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source), mode="r") as container:
            stream = container.streams.video[0]
            codec = stream.codec_context
            if codecs is not None and codec.name not in codecs:
                raise VideoError(f"{name}: codec {codec.name!r} is not one of {sorted(codecs)}")
            bound = max_pixels if frame_pixels is None else frame_pixels
            if codec.width * codec.height > bound:
                raise VideoError(f"{name}: frames of {codec.width}x{codec.height}, over {bound} pixels")
            rate = float(stream.average_rate or stream.guessed_rate or 0) or None
            for frame in container.decode(stream):
                if fps is None and len(decoded) >= max_frames:
                    raise VideoError(f"{name}: more than {max_frames} frames")
                if before_frame is not None:
                    before_frame(frame.width * frame.height * 3)
                decoded.append((float(frame.time or 0.0), frame.to_image()))
    except (av.FFmpegError, IndexError, OSError) as err:
        raise VideoError(f"{name}: cannot decode a video from it: {err}") from err
    if not decoded:
        raise VideoError(f"{name}: no video frames in it")
    if fps is None:
        return video_from_frames([image for _, image in decoded], rate or 1.0, max_frames=max_frames,
                                 max_pixels=max_pixels)
    duration = decoded[-1][0] + (decoded[-1][0] - decoded[0][0]) / max(len(decoded) - 1, 1)
    wanted = max(1, min(max_frames, round(duration * fps), len(decoded)))
    picks = np.linspace(0, len(decoded) - 1, wanted).round().astype(int)
    return video_from_frames([decoded[i][1] for i in picks], wanted / max(duration, 1e-9) if duration > 0 else fps,
                             max_frames=max_frames, max_pixels=max_pixels)


def lossless_bytes(video: Video) -> bytes:
    """`video` as a Matroska file of FFV1 frames (lossless 8-bit RGB) at its rate: `read_video(..., fps=None)` gives the
    very same frames back (how a clip travels to a server)."""
    av = _pyav()
    out = io.BytesIO()
    width, height = video.frames[0].size
    with av.open(out, "w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=Fraction(video.fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = width, height, "bgr0"
        for frame in video.frames:
            for packet in stream.encode(av.VideoFrame.from_image(frame).reformat(format="bgr0")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def _pyav() -> Any:
    """PyAV, which video files need (clips given as frames do not): the `video` extra."""
    try:
        import av
    except ImportError as err:
        raise VideoError("video files need PyAV: pip install 'relax-gym[video]' (or av)") from err
    return av
