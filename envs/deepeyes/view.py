"""What the model is looking at: a crop of the original image, resized and rotated.

A view is stored as plain data (`box` in original-image pixels, `rotation` in
degrees counter-clockwise), never as pixels, so episode snapshots stay small
and zooms compound exactly: a box drawn on the current view is mapped back
through its rotation and scale to original pixels, then cropped from the
original image again, so no resampling error accumulates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypedDict

from PIL import Image

MIN_CROP_SIDE = 8  # original pixels; less holds nothing a model could read
MAX_ASPECT = 50  # VLM processors reject very thin images (Qwen-VL: 200)

_TRANSPOSE = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180, 270: Image.Transpose.ROTATE_270}


class View(TypedDict):
    box: list[int]  # [x1, y1, x2, y2] in original-image pixels
    rotation: int  # 0, 90, 180 or 270 degrees counter-clockwise


def full_view(image: Image.Image) -> View:
    return {"box": [0, 0, image.width, image.height], "rotation": 0}


def display_size(width: int, height: int, min_side: int, max_side: int) -> tuple[int, int]:
    """Scales up until the short side reaches `min_side`, keeping aspect, but never past `max_side`."""
    scale = max(1.0, min_side / min(width, height))
    scale = min(scale, max_side / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def _box_size(view: View) -> tuple[int, int]:
    x1, y1, x2, y2 = view["box"]
    return x2 - x1, y2 - y1


def shown_size(view: View, min_side: int, max_side: int) -> tuple[int, int]:
    """The (width, height) the model sees, after rotation."""
    w, h = display_size(*_box_size(view), min_side, max_side)
    return (h, w) if view["rotation"] in (90, 270) else (w, h)


def render(image: Image.Image, view: View, min_side: int, max_side: int) -> Image.Image:
    """A new image of `view`: crop, resize, rotate."""
    size = display_size(*_box_size(view), min_side, max_side)
    x1, y1, x2, y2 = view["box"]
    out = image.crop((x1, y1, x2, y2))
    if out.size != size:
        out = out.resize(size, Image.Resampling.BICUBIC)
    return out.transpose(_TRANSPOSE[view["rotation"]]) if view["rotation"] else out


def _unrotate(x: float, y: float, rotation: int, width: float, height: float) -> tuple[float, float]:
    """A point of the rotated view back in the unrotated one (`width` x `height` before rotation)."""
    if rotation == 90:
        return width - y, x
    if rotation == 180:
        return width - x, height - y
    if rotation == 270:
        return y, height - x
    return x, y


def _checked_bbox(bbox: Sequence[float], normalized: bool, shown: tuple[int, int]) -> tuple[float, ...]:
    """The bbox in shown-view pixels, clipped to the view; ValueError says what is wrong."""
    if len(bbox) != 4:
        raise ValueError(f"bbox_2d must have 4 numbers [x1, y1, x2, y2], got {len(bbox)}")
    if not all(math.isfinite(v) for v in bbox):
        raise ValueError(f"bbox_2d must hold finite numbers, got {list(bbox)}")
    x1, y1, x2, y2 = bbox
    if x2 <= x1 or y2 <= y1:
        raise ValueError(f"bbox_2d must be [x1, y1, x2, y2] with x2 > x1 and y2 > y1, got {list(bbox)}")
    w, h = shown
    if normalized:
        x1, x2, y1, y2 = x1 * w / 1000, x2 * w / 1000, y1 * h / 1000, y2 * h / 1000
    if x1 >= w or y1 >= h or x2 <= 0 or y2 <= 0:
        extent = "0-1000 on both axes" if normalized else f"the current view's {w}x{h} pixels"
        raise ValueError(f"bbox_2d {list(bbox)} lies outside the image ({extent})")
    return max(x1, 0.0), max(y1, 0.0), min(x2, float(w)), min(y2, float(h))


def zoom(view: View, bbox: Sequence[float], *, normalized: bool, min_side: int, max_side: int) -> View:
    """The view inside `bbox` (drawn on the current view), keeping the rotation.

    A box reaching past the view's edge is clipped to it; one wholly outside it,
    inverted, non-finite, too small or too thin raises ValueError with the reason.
    """
    shown = shown_size(view, min_side, max_side)
    x1, y1, x2, y2 = _checked_bbox(bbox, normalized, shown)
    width, height = display_size(*_box_size(view), min_side, max_side)
    corners = [_unrotate(x, y, view["rotation"], width, height) for x, y in ((x1, y1), (x2, y2))]
    bx1, by1, bx2, by2 = view["box"]
    sx, sy = (bx2 - bx1) / width, (by2 - by1) / height
    xs = sorted(bx1 + x * sx for x, _ in corners)
    ys = sorted(by1 + y * sy for _, y in corners)
    # Round to 6 places first so float noise never widens the box by a pixel.
    box = [
        max(bx1, math.floor(round(xs[0], 6))),
        max(by1, math.floor(round(ys[0], 6))),
        min(bx2, math.ceil(round(xs[1], 6))),
        min(by2, math.ceil(round(ys[1], 6))),
    ]
    crop_w, crop_h = box[2] - box[0], box[3] - box[1]
    if min(crop_w, crop_h) < MIN_CROP_SIDE:
        raise ValueError(
            f"bbox_2d {list(bbox)} covers only {crop_w}x{crop_h} pixels of the original image; "
            f"each side needs at least {MIN_CROP_SIDE}, so draw a larger box"
        )
    if max(crop_w, crop_h) > MAX_ASPECT * min(crop_w, crop_h):
        raise ValueError(f"bbox_2d {list(bbox)} is too thin ({crop_w}x{crop_h}); keep it under {MAX_ASPECT}:1")
    return {"box": box, "rotation": view["rotation"]}


def rotate(view: View, angle: int) -> View:
    """The view turned `angle` degrees counter-clockwise; only quarter turns keep pixels exact."""
    if angle % 360 not in _TRANSPOSE:
        raise ValueError(f"angle must be 90, 180 or 270 (degrees counter-clockwise), got {angle}")
    return {"box": list(view["box"]), "rotation": (view["rotation"] + angle) % 360}
