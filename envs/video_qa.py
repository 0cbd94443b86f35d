"""VideoQA: multiple-choice questions about a short synthesised clip, answerable only from the motion.

Each task draws a clip of coloured shapes on a plain background and asks about what happens across its
frames, so no single frame answers it and the answer is known by construction:

- `count`: how many times a light flashes (it is lit in some frames, dark in the others);
- `direction`: which way a ball moves (left, right, up, down);
- `order`: which colour appears first, second, ... (one shape per frame segment);
- `moved`: which of two shapes moved while the other stayed put.

Clips are made in memory from the reset seed (nothing ships, nothing downloads); the options are lettered and
the answer goes in <answer></answer>, graded by `multiple_choice_reward`.
"""

from __future__ import annotations

import string
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from relax_gym.env.core import Env
from relax_gym.env.single_turn import SingleTurnEnv
from relax_gym.messages import Message, message, text, video
from relax_gym.rewards import RewardResult, multiple_choice_reward
from relax_gym.video import Video, video_from_frames

KINDS: tuple[str, ...] = ("count", "direction", "order", "moved")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30),
    "purple": (150, 60, 190),
}
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
ORDINALS: tuple[str, ...] = ("first", "second", "third", "fourth")
INSTRUCTION = "Answer with the letter of the correct option inside <answer></answer>, e.g. <answer>A</answer>."


class VideoQAEnv(SingleTurnEnv):
    """Watch the clip, pick the lettered option; reward 1 for the right letter in <answer></answer>."""

    metadata: dict[str, Any] = {**Env.metadata, "modalities": ("text", "video")}  # noqa: RUF012 (see Env.metadata)
    blocking = False  # a few small frames drawn per reset

    def __init__(self, kinds: tuple[str, ...] | list[str] = KINDS, frames: int = 8, width: int = 96,
                 height: int = 64, fps: float = 2.0, system_prompt: str | None = None):
        super().__init__()
        kinds = tuple(kinds)
        if not kinds or set(kinds) - set(KINDS):
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}")
        if not 4 <= frames <= 32:
            raise ValueError(f"frames must be in [4, 32], got {frames}")
        if width < 48 or height < 48:
            raise ValueError(f"frames must be at least 48x48 pixels, got {width}x{height}")
        if not fps > 0:
            raise ValueError(f"fps must be positive, got {fps}")
        self.kinds, self.frames, self.width, self.height, self.fps = kinds, frames, width, height, float(fps)
        self.system_prompt = system_prompt

    # --- episode ------------------------------------------------------------------
    def new_task(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        kind = options.get("kind") or self.kinds[int(rng.integers(len(self.kinds)))]
        if kind not in KINDS:
            raise ValueError(f"options['kind'] must be one of {KINDS}, got {kind!r}")
        clip, question, choices = getattr(self, f"_{kind}")(rng)
        order = rng.permutation(len(choices))
        shuffled = [choices[i] for i in order]
        letter = string.ascii_uppercase[int(np.flatnonzero(order == 0)[0])]  # choices[0] is the right one
        return {"kind": kind, "clip": clip, "question": question, "choices": shuffled, "answer": letter}

    def prompt_messages(self, task: dict[str, Any]) -> list[Message]:
        options = "\n".join(f"{string.ascii_uppercase[i]}. {c}" for i, c in enumerate(task["choices"]))
        head = [message("system", self.system_prompt)] if self.system_prompt else []
        return [*head, message("user", video(task["clip"]), text(f"{task['question']}\n{options}\n{INSTRUCTION}"))]

    def grade(self, task: dict[str, Any], answer: str) -> RewardResult:
        return multiple_choice_reward(answer, task["answer"], choices=task["choices"])

    def task_info(self, task: dict[str, Any]) -> dict[str, Any]:
        return {"kind": task["kind"], "answer": task["answer"], "frames": len(task["clip"].frames)}

    # --- clips: each returns (clip, question, options with the right one first) ------------------------------
    def _canvas(self) -> list[Image.Image]:
        return [Image.new("RGB", (self.width, self.height), (245, 245, 245)) for _ in range(self.frames)]

    def _clip(self, frames: list[Image.Image]) -> Video:
        return video_from_frames(frames, self.fps)

    def _count(self, rng: np.random.Generator) -> tuple[Video, str, list[str]]:
        """A light that is lit for some one-frame flashes, dark in between (flashes never touch)."""
        flashes = int(rng.integers(1, min((self.frames + 1) // 2, 4) + 1))
        slots = sorted(rng.choice(np.arange(0, self.frames, 2), size=flashes, replace=False).tolist())
        colour = COLOURS[list(COLOURS)[int(rng.integers(len(COLOURS)))]]
        frames = self._canvas()
        box = (self.width // 2 - 12, self.height // 2 - 12, self.width // 2 + 12, self.height // 2 + 12)
        for i, frame in enumerate(frames):
            ImageDraw.Draw(frame).ellipse(box, fill=colour if i in slots else (90, 90, 90))
        wrong = [n for n in range(1, 6) if n != flashes]
        picks = [str(flashes), *(str(n) for n in rng.choice(wrong, size=3, replace=False))]
        return self._clip(frames), "How many times does the light flash?", picks

    def _direction(self, rng: np.random.Generator) -> tuple[Video, str, list[str]]:
        """A ball crossing the frame in a straight line."""
        way = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
        colour = COLOURS[list(COLOURS)[int(rng.integers(len(COLOURS)))]]
        r = 8
        xs = np.linspace(r + 2, self.width - r - 2, self.frames)
        ys = np.linspace(r + 2, self.height - r - 2, self.frames)
        mid_x, mid_y = self.width / 2, self.height / 2
        frames = self._canvas()
        for i, frame in enumerate(frames):
            x, y = {"right": (xs[i], mid_y), "left": (xs[-1 - i], mid_y), "down": (mid_x, ys[i]),
                    "up": (mid_x, ys[-1 - i])}[way]
            ImageDraw.Draw(frame).ellipse((x - r, y - r, x + r, y + r), fill=colour)
        return self._clip(frames), "Which way does the ball move?", [way, *(d for d in DIRECTIONS if d != way)]

    def _order(self, rng: np.random.Generator) -> tuple[Video, str, list[str]]:
        """Shapes of different colours shown one after another, each for an equal run of frames."""
        shown = min(4, self.frames // 2)
        names = [list(COLOURS)[i] for i in rng.choice(len(COLOURS), size=shown, replace=False)]
        which = int(rng.integers(shown))
        frames = self._canvas()
        per = self.frames // shown
        for i, frame in enumerate(frames):
            name = names[min(i // per, shown - 1)]
            ImageDraw.Draw(frame).rectangle((self.width // 2 - 14, self.height // 2 - 14, self.width // 2 + 14,
                                             self.height // 2 + 14), fill=COLOURS[name])
        right = names[which]
        others = [n for n in COLOURS if n != right]
        picks = [right, *(str(n) for n in rng.choice(others, size=3, replace=False))]
        return self._clip(frames), f"Which colour is shown {ORDINALS[which]}?", picks

    def _moved(self, rng: np.random.Generator) -> tuple[Video, str, list[str]]:
        """Two shapes: one slides across its half of the frame, the other stays where it is."""
        a, b = (list(COLOURS)[i] for i in rng.choice(len(COLOURS), size=2, replace=False))
        mover = int(rng.integers(2))
        half = self.height // 2
        frames = self._canvas()
        still_x = float(rng.integers(10, self.width - 10))
        path = np.linspace(10, self.width - 10, self.frames)
        for i, frame in enumerate(frames):
            draw = ImageDraw.Draw(frame)
            for row, name in enumerate((a, b)):
                x = path[i] if row == mover else still_x
                y = half // 2 + row * half
                draw.rectangle((x - 7, y - 7, x + 7, y + 7), fill=COLOURS[name])
        moved, stayed = (a, b) if mover == 0 else (b, a)
        return (self._clip(frames), "Which shape moves while the other stays still?",
                [f"the {moved} one", f"the {stayed} one", "both", "neither"])
