"""Qwen-VL video preprocessing without torchvision: a clip's frames in, `pixel_values_videos` out.

transformers' video processors (`Qwen3VLVideoProcessor`, the Qwen-Omni ones) subclass its torchvision
backend and cannot even be constructed without torchvision, which does not install beside the CPU torch
wheel these machines carry. `FramesVideoProcessor` is the same computation on torch and numpy over frames that
are already decoded and sampled (a `Video`'s): the 8-bit frames resized to the clip's `smart_resize` size by
the very call torchvision makes (`interpolate`, bicubic, antialiased, on uint8), rescaled, normalised, the
frame count padded to a multiple of `temporal_patch_size` with the last frame, and the clip cut into
[grid_t x grid_h x grid_w, C x T x P x P] patches in the Qwen-VL order. tests/models/test_video.py holds the stock
`Qwen3VLVideoProcessor`'s outputs (made by tests/fixtures/make_qwen_video_reference.py where torchvision
installs) and checks this one gives them.

It subclasses transformers' `VideoProcessorMixin` (what processors check their video part against) and
answers the calls the Qwen3-VL and Qwen3-Omni processors make of it: `__call__(videos, **videos_kwargs)`
with `video_metadata` / `return_metadata` (Qwen3-VL's timestamps), and its `merge_size`,
`temporal_patch_size` and `get_num_of_video_patches`.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import BatchFeature, ProcessorMixin
from transformers.video_processing_utils import VideoProcessorMixin
from transformers.video_utils import VideoMetadata

from relax_gym.video import Video, VideoError

#: transformers' IMAGENET_STANDARD_MEAN / _STD, the Qwen-VL video processors' defaults
STANDARD_MEAN = (0.5, 0.5, 0.5)
STANDARD_STD = (0.5, 0.5, 0.5)


def smart_resize(frames: int, height: int, width: int, *, factor: int, temporal_factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """The frame size a Qwen-VL video processor resizes a clip of `frames` frames to: both sides multiples of
    `factor`, the aspect ratio kept, and frames x height x width (frames rounded to `temporal_factor`) within
    [min_pixels, max_pixels]. Qwen3-VL's rule, which Qwen2-VL's and the Omni models' share."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise VideoError(f"a video frame of {width}x{height}: aspect ratio over 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class FramesVideoProcessor(VideoProcessorMixin):
    """Qwen-VL video preprocessing of sampled frames on torch and numpy (see the module's docstring)."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]  # noqa: RUF012 (the base class's attribute)

    def __init__(self, *, patch_size: int = 16, temporal_patch_size: int = 2, merge_size: int = 2,
                 size: dict[str, int] | None = None, image_mean: Sequence[float] = STANDARD_MEAN,
                 image_std: Sequence[float] = STANDARD_STD, rescale_factor: float = 1 / 255,
                 stands_for: str = "Qwen3VLVideoProcessor"):
        """`stands_for`: the stock class whose name a saved folder gives (so transformers with torchvision loads
        the stock one from it); its other settings are the stock class's of the same names."""
        super().__init__()
        self.stands_for = stands_for
        self.patch_size, self.temporal_patch_size, self.merge_size = patch_size, temporal_patch_size, merge_size
        #: pixels per clip (frames x height x width after resizing), as the stock processors' `size` holds them
        self.size = dict(size or {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32})
        self.image_mean, self.image_std = list(image_mean), list(image_std)
        self.rescale_factor = rescale_factor

    def preprocess(self, videos: Any, *, video_metadata: Any = None, return_metadata: bool = False,
                   return_tensors: Any = None, size: dict[str, int] | None = None, fps: float | None = None,
                   do_sample_frames: bool | None = None, **_: Any) -> BatchFeature:
        """`videos`: `Video`s, or clips of frames (lists of PIL images or HxWx3 arrays, or TxHxWx3 arrays) whose rate
        `video_metadata` or `fps` gives. Frames are used as given: sampling is the caller's (a `Video` is sampled)."""
        if do_sample_frames:
            raise ValueError("FramesVideoProcessor takes frames already sampled (a Video's): do_sample_frames=True")
        clips = videos if isinstance(videos, list | tuple) and not _is_frame(videos[0]) else [videos]
        metadata = video_metadata if isinstance(video_metadata, list | tuple) else [video_metadata] * len(clips)
        size = dict(size or self.size)
        patches, grids, metas = [], [], []
        for clip, meta in zip(clips, metadata, strict=True):
            frames = _frames(clip)
            rate = clip.fps if isinstance(clip, Video) else _rate(meta, fps)
            flat, grid = self._clip(frames, size)
            patches.append(flat)
            grids.append(grid)
            metas.append(VideoMetadata(total_num_frames=len(frames), fps=rate, width=frames.shape[2],
                                       height=frames.shape[1], frames_indices=list(range(len(frames)))))
        data: dict[str, Any] = {"pixel_values_videos": np.concatenate(patches),
                                "video_grid_thw": np.asarray(grids, dtype=np.int64)}
        out = BatchFeature(data=data, tensor_type=return_tensors)
        if return_metadata:
            out["video_metadata"] = metas
        return out

    def _clip(self, frames: np.ndarray, size: dict[str, int]) -> tuple[np.ndarray, list[int]]:
        """One clip's [T, H, W, 3] uint8 frames as flat patches and their (t, h, w) grid."""
        p, t, m = self.patch_size, self.temporal_patch_size, self.merge_size
        height, width = frames.shape[1:3]
        h, w = smart_resize(len(frames), height, width, factor=p * m, temporal_factor=t,
                            min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        stacked = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        if (h, w) != (height, width):  # torchvision's resize of 8-bit frames is this call, on torch alone
            stacked = torch.nn.functional.interpolate(stacked.contiguous(), size=(h, w), mode="bicubic",
                                                      align_corners=False, antialias=True)
        mean = np.asarray(self.image_mean, np.float32)[:, None, None]
        std = np.asarray(self.image_std, np.float32)[:, None, None]
        pixels = (stacked.numpy().astype(np.float32) * np.float32(self.rescale_factor) - mean) / std  # [T, C, H, W]
        if pad := -len(frames) % t:
            pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
        grid_t, grid_h, grid_w = pixels.shape[0] // t, h // p, w // p
        channels = pixels.shape[1]
        blocks = pixels.reshape(grid_t, t, channels, grid_h // m, m, p, grid_w // m, m, p)
        blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, T, P, P]
        return np.ascontiguousarray(blocks).reshape(grid_t * grid_h * grid_w, channels * t * p * p), \
            [grid_t, grid_h, grid_w]

    def to_dict(self) -> dict[str, Any]:
        """The settings as the stock class takes them, under its name; frames are never sampled again."""
        return {"video_processor_type": self.stands_for, "patch_size": self.patch_size,
                "temporal_patch_size": self.temporal_patch_size, "merge_size": self.merge_size,
                "size": dict(self.size), "image_mean": list(self.image_mean), "image_std": list(self.image_std),
                "rescale_factor": self.rescale_factor, "do_sample_frames": False}

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> FramesVideoProcessor:
        """The processor a saved folder's video settings (a stock video processor's or this one's) describe."""
        size = settings.get("size") or {}
        if "min_pixels" in settings or "max_pixels" in settings:  # older folders name the bounds so
            size = {"shortest_edge": settings.get("min_pixels"), "longest_edge": settings.get("max_pixels")}
        keys = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor")
        return cls(**{k: settings[k] for k in keys if settings.get(k) is not None},
                   size={k: int(v) for k, v in size.items() if v is not None} or None,
                   stands_for=str(settings.get("video_processor_type") or "Qwen3VLVideoProcessor"))

    def get_num_of_video_patches(self, num_frames: int, height: int, width: int,
                                 videos_kwargs: dict[str, Any] | None = None) -> int:
        size = (videos_kwargs or {}).get("size") or self.size
        p, t, m = self.patch_size, self.temporal_patch_size, self.merge_size
        h, w = smart_resize(num_frames, height, width, factor=p * m, temporal_factor=t,
                            min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        return (num_frames + -num_frames % t) // t * (h // p) * (w // p)


def _is_frame(value: Any) -> bool:
    return isinstance(value, Image.Image) or (isinstance(value, np.ndarray) and value.ndim == 3)


def _frames(clip: Any) -> np.ndarray:
    """A clip's frames as one [T, H, W, 3] uint8 array."""
    if isinstance(clip, Video):
        clip = clip.frames
    if isinstance(clip, np.ndarray | torch.Tensor) and clip.ndim == 4:
        frames = np.asarray(clip)
    else:
        frames = np.stack([np.asarray(f.convert("RGB") if isinstance(f, Image.Image) else f) for f in clip])
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise VideoError(f"a clip's frames must be RGB (T x H x W x 3), got shape {frames.shape}")
    return frames.astype(np.uint8, copy=False)


def _rate(meta: Any, fps: float | None) -> float | None:
    given = getattr(meta, "fps", None) if not isinstance(meta, dict) else meta.get("fps")
    return float(given) if given else fps


@functools.cache
def frames_video(processor_cls: type[ProcessorMixin]) -> type[ProcessorMixin]:
    """`processor_cls` (a Qwen-VL or Omni processor) with a `FramesVideoProcessor` for its video part.

    transformers checks a processor's parts against its exported base classes, and without torchvision it
    exports no video base class at all, so the stock processor refuses any video part; loading a folder would
    also build the stock video processor. This subclass accepts a `FramesVideoProcessor` and builds one from a
    folder's saved video settings (processor_config.json's, or video_preprocessor_config.json). It keeps the
    stock class's name, so saved folders name the stock class. Processors without a video part come back as
    they are."""
    attributes = processor_cls.get_attributes()
    if "video_processor" not in attributes:
        return processor_cls

    def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
        if isinstance(argument, FramesVideoProcessor):
            return FramesVideoProcessor
        return super(framed, self).check_argument_for_proper_class(argument_name, argument)

    def get_attributes(cls: Any) -> list[str]:
        return [a for a in attributes if a != "video_processor"] if cls._loading_others else list(attributes)

    def _get_arguments_from_pretrained(cls: Any, path: Any, processor_dict: Any = None, **kwargs: Any) -> list[Any]:
        cls._loading_others = True  # the stock loader for every other part (folders load one at a time)
        try:
            args = super(framed, cls)._get_arguments_from_pretrained(path, processor_dict, **kwargs)
        finally:
            cls._loading_others = False
        args.insert(attributes.index("video_processor"), FramesVideoProcessor.from_settings(
            _video_settings(Path(path), processor_dict or {})))
        return args

    framed: type[ProcessorMixin] = type(processor_cls.__name__, (processor_cls,), {
        "__module__": processor_cls.__module__, "_loading_others": False,
        "check_argument_for_proper_class": check_argument_for_proper_class,
        "get_attributes": classmethod(get_attributes),
        "_get_arguments_from_pretrained": classmethod(_get_arguments_from_pretrained),
    })
    return framed


def _video_settings(folder: Path, processor_dict: dict[str, Any]) -> dict[str, Any]:
    """A folder's video processor settings: processor_config.json's `video_processor`, else the separate file."""
    if isinstance(processor_dict.get("video_processor"), dict):
        return dict(processor_dict["video_processor"])
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (folder / name).is_file():
            return dict(json.loads((folder / name).read_text(encoding="utf-8")))
    return {}
