"""Generates the shipped DeepEyes-style data: cluttered images whose answer needs a zoom.

Each 896x672 image (a 32x24 grid of Qwen-VL's 28-pixel patches) holds clutter,
readable distractor words and one small target: a 4-digit code or a word on a
tiny sign among decoy signs of other colours, a tiny shape inside a framed
box, dots to count in a small box, or an arrow in a small badge. The target
spans about one patch, so a VLM reading the whole image sees it only as a few
pixels; `image_zoom_in` on `extra_info.target_bbox` makes it legible.

Records follow DeepEyes-47k (`data_source`, `prompt`, `images`,
`reward_model.ground_truth`, `extra_info`) with image paths relative to the
jsonl. Every image draws from its own seeded `random.Random`, so any prefix of
the data regenerates bit for bit.

    python scripts/make_deepeyes_data.py [--out envs/data/deepeyes] [--train 48] [--test 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

WIDTH, HEIGHT = 896, 672
DATA_SOURCE = "relax_gym/deepeyes-synthetic"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "envs" / "data" / "deepeyes"

Box = tuple[int, int, int, int]
Rgb = tuple[int, int, int]

# Saturated, nameable colours for targets; clutter uses muted tones so no
# distractor can be mistaken for a target.
TARGET_COLOURS: dict[str, Rgb] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (250, 210, 0),
    "purple": (140, 40, 180),
    "orange": (250, 130, 0),
}
CLUTTER_COLOURS = [
    (200, 190, 170),
    (170, 185, 200),
    (190, 200, 175),
    (210, 185, 190),
    (160, 160, 160),
    (120, 130, 140),
    (215, 205, 150),
    (150, 175, 165),
    (185, 170, 200),
    (140, 120, 110),
]
WORDS = [
    "harbor",
    "maple",
    "copper",
    "lantern",
    "violet",
    "summit",
    "falcon",
    "garden",
    "rocket",
    "canyon",
    "pepper",
    "marble",
    "silver",
    "meadow",
    "anchor",
    "cobalt",
    "willow",
    "glacier",
    "quartz",
    "bamboo",
    "tunnel",
    "saddle",
    "comet",
    "orchid",
    "pillar",
    "ribbon",
    "walnut",
    "island",
    "velvet",
    "thunder",
]
# Large, readable words that never appear on a sign, so they cannot leak an answer.
DISTRACTOR_WORDS = ["EXIT", "NORTH", "PLAZA", "DEPOT", "MARKET", "STATION", "GATE", "LEVEL", "ZONE", "PARK"]
DIRECTIONS = ("up", "down", "left", "right")
# An upward arrow around the badge centre: shaft tail, shaft head, then the
# triangle's three corners; the other directions are exact quarter turns of it.
ARROW_UP = [(0, 6), (0, -1), (-4, -1), (0, -7), (4, -1)]
ARROW_TURNS: dict[str, Callable[[int, int], tuple[int, int]]] = {
    "up": lambda x, y: (x, y),
    "down": lambda x, y: (x, -y),
    "left": lambda x, y: (y, x),
    "right": lambda x, y: (-y, x),
}
SMALL_FONT = 8  # digits ~6 px tall: a smudge at full view, legible after a zoom


def font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


def overlaps(box: Box, others: list[Box], pad: int = 6) -> bool:
    return any(
        box[0] < o[2] + pad and o[0] < box[2] + pad and box[1] < o[3] + pad and o[1] < box[3] + pad
        for o in others
    )


def place(rng: random.Random, w: int, h: int, taken: list[Box], margin: int = 24) -> Box:
    """A free spot for a w x h item, kept off earlier placed items so targets stay unoccluded."""
    for _ in range(500):
        x, y = rng.randint(margin, WIDTH - margin - w), rng.randint(margin, HEIGHT - margin - h)
        box = (x, y, x + w, y + h)
        if not overlaps(box, taken):
            taken.append(box)
            return box
    raise RuntimeError("could not place an item; the canvas is too crowded")


def draw_clutter(draw: ImageDraw.ImageDraw, rng: random.Random) -> None:
    """Muted panels, blobs and lines, then large readable distractor words."""
    for _ in range(rng.randint(6, 9)):
        x, y = rng.randint(0, WIDTH - 120), rng.randint(0, HEIGHT - 90)
        size = rng.randint(120, 320), rng.randint(90, 240)
        draw.rectangle((x, y, x + size[0], y + size[1]), fill=rng.choice(CLUTTER_COLOURS))
    for _ in range(rng.randint(25, 40)):
        x, y, s = rng.randint(0, WIDTH), rng.randint(0, HEIGHT), rng.randint(14, 70)
        shape = rng.choice((draw.ellipse, draw.rectangle))
        shape((x, y, x + s, y + int(s * rng.uniform(0.5, 1.5))), fill=rng.choice(CLUTTER_COLOURS))
    for _ in range(rng.randint(8, 14)):
        xy = [(rng.randint(0, WIDTH), rng.randint(0, HEIGHT)) for _ in range(2)]
        draw.line(xy, fill=rng.choice(CLUTTER_COLOURS), width=rng.randint(2, 5))
    for word in rng.sample(DISTRACTOR_WORDS, 5):
        xy = (rng.randint(10, WIDTH - 160), rng.randint(10, HEIGHT - 40))
        draw.text(xy, word, fill=(90, 90, 100), font=font(rng.randint(18, 28)))


def sign(draw: ImageDraw.ImageDraw, rng: random.Random, taken: list[Box], label: str, colour: Rgb) -> Box:
    """A small coloured plate with tiny text; returns its box."""
    left, top, right, bottom = font(SMALL_FONT).getbbox(label)
    w, h = right - left + 8, bottom - top + 8
    box = place(rng, w, h, taken)
    draw.rectangle(box, fill=colour, outline=(40, 40, 40))
    ink = (0, 0, 0) if sum(colour) > 450 else (255, 255, 255)
    draw.text((box[0] + 4 - left, box[1] + 4 - top), label, fill=ink, font=font(SMALL_FONT))
    return box


def signs_task(draw: ImageDraw.ImageDraw, rng: random.Random, taken: list[Box], kind: str) -> dict[str, Any]:
    """A code or word on one tiny sign, among decoy signs of other colours."""
    colours = rng.sample(sorted(TARGET_COLOURS), 4)
    labels = [str(rng.randint(1000, 9999)) for _ in colours] if kind == "code" else rng.sample(WORDS, 4)
    labels = [lab.upper() for lab in labels]
    box = sign(draw, rng, taken, labels[0], TARGET_COLOURS[colours[0]])
    for label, colour in zip(labels[1:], colours[1:], strict=True):
        sign(draw, rng, taken, label, TARGET_COLOURS[colour])
    what = "4-digit code" if kind == "code" else "word"
    question = f"What {what} is written on the small {colours[0]} sign? Answer with the {what} only."
    return {"question": question, "answer": labels[0], "bbox": box}


def framed_box(draw: ImageDraw.ImageDraw, rng: random.Random, taken: list[Box], side: int, frame: Rgb) -> Box:
    box = place(rng, side, side, taken)
    draw.rectangle(box, fill=(255, 255, 255), outline=frame, width=2)
    return box


def tiny_shape(draw: ImageDraw.ImageDraw, box: Box, shape: str, colour: Rgb) -> None:
    """A ~10-pixel triangle, square or disc centred in `box`."""
    cx, cy = (box[0] + box[2]) // 2, (box[1] + box[3]) // 2
    if shape == "triangle":
        draw.polygon([(cx, cy - 5), (cx - 5, cy + 4), (cx + 5, cy + 4)], fill=colour)
    elif shape == "square":
        draw.rectangle((cx - 4, cy - 4, cx + 4, cy + 4), fill=colour)
    else:
        draw.ellipse((cx - 5, cy - 5, cx + 5, cy + 5), fill=colour)


def shape_task(draw: ImageDraw.ImageDraw, rng: random.Random, taken: list[Box]) -> dict[str, Any]:
    """Framed boxes each hold a tiny shape; the triangle's colour is the answer."""
    colours = rng.sample(sorted(TARGET_COLOURS), 4)
    shapes = ["triangle", *rng.choices(("square", "disc"), k=3)]
    boxes = [framed_box(draw, rng, taken, 22, (0, 0, 0)) for _ in shapes]
    for box, shape, colour in zip(boxes, shapes, colours, strict=True):
        tiny_shape(draw, box, shape, TARGET_COLOURS[colour])
    question = (
        "Several small white boxes with black frames each hold a tiny shape. "
        "What colour is the triangle? Answer with one word."
    )
    return {"question": question, "answer": colours[0], "bbox": boxes[0]}


def dots(draw: ImageDraw.ImageDraw, rng: random.Random, box: Box, count: int) -> None:
    """`count` dots of radius 2 on a 4x4 grid inside `box`, so they never touch."""
    for i, j in rng.sample([(i, j) for i in range(4) for j in range(4)], count):
        cx, cy = box[0] + 7 + 7 * i, box[1] + 7 + 7 * j
        draw.ellipse((cx - 2, cy - 2, cx + 2, cy + 2), fill=(0, 0, 0))


def dots_task(draw: ImageDraw.ImageDraw, rng: random.Random, taken: list[Box]) -> dict[str, Any]:
    """Dots to count in a 36-pixel red-framed box, beside decoy boxes with other frames."""
    frames = ["red", *rng.sample(["blue", "green", "purple"], 2)]
    counts = rng.sample(range(2, 8), 3)
    boxes = []
    for frame, count in zip(frames, counts, strict=True):
        boxes.append(framed_box(draw, rng, taken, 36, TARGET_COLOURS[frame]))
        dots(draw, rng, boxes[-1], count)
    question = "How many black dots are inside the small box with a red frame? Answer with a number."
    return {"question": question, "answer": str(counts[0]), "bbox": boxes[0]}


def arrow(draw: ImageDraw.ImageDraw, box: Box, direction: str) -> None:
    cx, cy = (box[0] + box[2]) // 2, (box[1] + box[3]) // 2
    turn = ARROW_TURNS[direction]
    pts = [(cx + a, cy + b) for a, b in (turn(x, y) for x, y in ARROW_UP)]
    draw.line([pts[0], pts[1]], fill=(255, 255, 255), width=2)
    draw.polygon(pts[2:5], fill=(255, 255, 255))


def arrow_task(draw: ImageDraw.ImageDraw, rng: random.Random, taken: list[Box]) -> dict[str, Any]:
    """Arrows in small badges of different colours; multiple choice over shuffled directions."""
    colours = rng.sample(sorted(TARGET_COLOURS), 3)
    directions = rng.choices(DIRECTIONS, k=3)
    boxes = []
    for colour, direction in zip(colours, directions, strict=True):
        boxes.append(place(rng, 20, 20, taken))
        draw.ellipse(boxes[-1], fill=TARGET_COLOURS[colour])
        arrow(draw, boxes[-1], direction)
    options = rng.sample(DIRECTIONS, 4)
    letters = "ABCD"
    lines = "\n".join(f"({letter}) {option}" for letter, option in zip(letters, options, strict=True))
    question = (
        f"Which way does the arrow in the small {colours[0]} circle point?\n{lines}\nAnswer with the letter."
    )
    answer = letters[options.index(directions[0])]
    return {"question": question, "answer": answer, "bbox": boxes[0], "choices": list(letters)}


TASKS: dict[str, Callable[..., dict[str, Any]]] = {
    "code": lambda d, r, t: signs_task(d, r, t, "code"),
    "word": lambda d, r, t: signs_task(d, r, t, "word"),
    "shape_colour": shape_task,
    "dot_count": dots_task,
    "arrow": arrow_task,
}


def make_example(seed: int, split: str, index: int) -> tuple[Image.Image, dict[str, Any]]:
    """One image and its record; the task kind cycles so every split holds each kind."""
    rng = random.Random(f"deepeyes-{seed}-{split}-{index}")
    kind = list(TASKS)[index % len(TASKS)]
    image = Image.new("RGB", (WIDTH, HEIGHT), (236, 233, 226))
    draw = ImageDraw.Draw(image)
    draw_clutter(draw, rng)
    task = TASKS[kind](draw, rng, [])
    name = f"images/{split}_{index:03d}.png"
    extra = {
        "split": split,
        "index": index,
        "task_type": kind,
        "question": task["question"],
        "answer": task["answer"],
        "target_bbox": list(task["bbox"]),
        "image_size": [WIDTH, HEIGHT],
    }
    if "choices" in task:
        extra["choices"] = task["choices"]
    record = {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": "<image>\n" + task["question"]}],
        "images": [{"path": name}],
        "ability": "visual_search",
        "reward_model": {"style": "rule", "ground_truth": task["answer"]},
        "extra_info": extra,
    }
    return image, record


def generate(out: Path, n_train: int = 48, n_test: int = 16, seed: int = 0) -> None:
    (out / "images").mkdir(parents=True, exist_ok=True)
    for split, count in (("train", n_train), ("test", n_test)):
        lines = []
        for index in range(count):
            image, record = make_example(seed, split, index)
            image.save(out / record["images"][0]["path"], optimize=True)
            lines.append(json.dumps(record, ensure_ascii=False))
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--train", type=int, default=48)
    parser.add_argument("--test", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    generate(args.out, args.train, args.test, args.seed)


if __name__ == "__main__":
    main()
