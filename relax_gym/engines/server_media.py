"""Images, audio and video as `relax-gym serve` takes them: inline only, their size checked before decoding.

Only data URLs and bare base64 are read: a server path would let any client learn which files exist
and make the server read them (a 3 GB sparse file was read whole). An image's pixel count comes from its
header, an audio clip's length from its format's header, and both are refused past the limits before
anything is decoded, so a decompression bomb costs the server only its compressed bytes. A video's frame
size comes from its stream's header, its frames are counted as they decode (past the limit it is refused),
and only a few lossless or common codecs are decoded at all (FFmpeg's many decoders are attack surface).
Every item is also charged to its request's `MediaBudget`, the decoded bytes summed over the request's items,
from the same headers before it decodes (a video's frame by frame): items each within their caps cannot add up
to gigabytes.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from collections.abc import Callable

import numpy as np
import soundfile
from PIL import Image

from relax_gym.engines.base import RequestError
from relax_gym.engines.server_limits import ServerLimits
from relax_gym.video import Video, VideoError, read_video

#: image formats decoded at all: PIL's many rarer decoders are attack surface no VLM client needs
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
#: video decoders used at all: FFV1 (what the SGLang client sends: lossless) and the common web codecs
VIDEO_CODECS = frozenset({"ffv1", "h264", "hevc", "vp8", "vp9", "av1", "libdav1d", "mpeg4"})
MAX_AUDIO_CHANNELS = 8
MAX_AUDIO_RATE = 384_000


class MediaError(ValueError):
    """A media item that cannot be used; the message names the field."""


class MediaBudget:
    """The decoded bytes one request's media may take, summed over its items (`max_media_mb`)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes, self.used = limit_bytes, 0

    def take(self, size: int, where: str) -> None:
        """Charges `size` decoded bytes for `where`, or refuses it (MediaError) past the request's limit."""
        if self.used + size > self.limit_bytes:
            raise MediaError(f"{where}: decoding it would bring the request's media to {self.used + size} bytes, "
                             f"over the server's limit of {self.limit_bytes} (max_media_mb)")
        self.used += size


def inline_bytes(item: str, where: str) -> bytes:
    """A data URL's or bare base64's bytes."""
    if item.startswith("data:"):
        item = item.partition(",")[2]
    elif item.startswith(("http://", "https://", "file:")):
        raise MediaError(f"{where}: only inline media are taken (a data URL or base64), not URLs")
    try:
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{where}: not a data URL or base64 (server paths are not read)") from None


def decode_image(item: str, where: str, *, max_pixels: int, budget: MediaBudget | None = None) -> Image.Image:
    """The image, refused past `max_pixels` by its header's size (before its pixels are decoded), and charged to
    `budget` (its bands x pixels)."""
    data = inline_bytes(item, where)
    too_many = f"over the server's limit of {max_pixels} pixels (max_image_pixels)"
    try:
        with warnings.catch_warnings():
            # PIL's own, higher bound (warning, then error) fires inside open(), before ours can
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
            width, height = image.size
            if width * height > max_pixels:
                raise MediaError(f"{where}: {width}x{height} is {width * height} pixels, {too_many}")
            if budget is not None:
                budget.take(width * height * len(image.getbands()), where)
            image.load()
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise MediaError(f"{where}: {too_many}; PIL says: {err}") from None
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, struct.error, DecompressionBomb*...
        raise MediaError(f"{where}: cannot decode an image ({', '.join(IMAGE_FORMATS)}): {err}") from None
    return image


def decode_audio(item: str, where: str, *, max_seconds: float,
                 budget: MediaBudget | None = None) -> tuple[np.ndarray, int]:
    """A mono float32 wave and its rate, refused past `max_seconds` by its header's length, and charged to
    `budget` (every channel's float32 samples, as they decode)."""
    data = inline_bytes(item, where)
    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception as err:  # libsndfile's errors come as LibsndfileError, RuntimeError or TypeError
        raise MediaError(f"{where}: cannot decode audio (WAV, FLAC or OGG expected): {err}") from None
    if not (0 < info.samplerate <= MAX_AUDIO_RATE and 0 < info.channels <= MAX_AUDIO_CHANNELS):
        raise MediaError(f"{where}: {info.channels} channels at {info.samplerate} Hz is not a supported layout "
                         f"(1-{MAX_AUDIO_CHANNELS} channels, up to {MAX_AUDIO_RATE} Hz)")
    seconds = info.frames / info.samplerate
    if seconds > max_seconds:
        raise MediaError(f"{where}: {seconds:.1f} s of audio is over the server's limit of {max_seconds:g} s "
                         "(max_audio_s)")
    if budget is not None:
        budget.take(info.frames * info.channels * 4, where)
    try:
        wave, rate = soundfile.read(io.BytesIO(data), dtype="float32", frames=info.frames)
    except Exception as err:
        raise MediaError(f"{where}: cannot decode audio: {err}") from None
    return (wave.mean(axis=1) if wave.ndim == 2 else wave), int(rate)


def decode_video(item: str, where: str, *, max_frames: int, max_pixels: int,
                 budget: MediaBudget | None = None) -> Video:
    """Every frame of the clip at its own rate (the client sampled them), refused past `max_frames` frames or
    frames of more than `max_pixels` pixels, each frame charged to `budget` (RGB) before it decodes."""
    data = inline_bytes(item, where)
    charge = None if budget is None else (lambda size: budget.take(size, where))
    try:
        return read_video(data, fps=None, max_frames=max_frames, max_pixels=max_frames * max_pixels,
                          codecs=VIDEO_CODECS, frame_pixels=max_pixels, before_frame=charge)
    except VideoError as err:
        raise MediaError(f"{where}: {err}") from None


def not_taken(model: str, modalities: tuple[str, ...], kind: str) -> str:
    """What a model that takes no `kind` input says of it, the words `models.inputs` uses."""
    return f"model {model!r} takes {'text only' if modalities == ('text',) else ', '.join(modalities)}, not {kind}"


def image_reader(model: str, modalities: tuple[str, ...], limits: ServerLimits) -> Callable[[str, str], Image.Image]:
    """One chat request's reader of `image_url` parts (`reader(url, where)`), under `limits`: refused for a model that
    takes no images before any decoding, past `max_media_items` images, and past `max_media_bytes` decoded over the
    request's images. A refusal is the request's error (`RequestError`, a 400 naming the part), never the server's:
    `relax-gym serve` and the agent proxy both read a chat's images through this."""
    budget = MediaBudget(limits.max_media_bytes)
    count = 0

    def read(url: str, where: str) -> Image.Image:
        nonlocal count
        if "image" not in modalities:
            raise RequestError(f"{where}: {not_taken(model, modalities, 'images')}")
        count += 1
        if count > limits.max_media_items:
            raise RequestError(f"{where}: more than {limits.max_media_items} images in one request (max_media_items)")
        try:
            return decode_image(url, where, max_pixels=limits.max_image_pixels, budget=budget)
        except MediaError as err:
            raise RequestError(str(err)) from None

    return read
