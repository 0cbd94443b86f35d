"""`DeepEyesEnv`: answer a question about a small detail of an image, zooming in with tools.

Follows DeepEyes ("Thinking with Images", arXiv 2505.14362): the model sees
the whole image, may call `image_zoom_in` / `image_rotate` (each result is a
new image appended to the conversation), and answers in `<answer>...</answer>`.

Reward of the final turn (weights are constructor arguments):

    acc_weight * accuracy + format_weight * format + tool_weight * tool

- accuracy: the `judge` when given (e.g. an LLM judge, as DeepEyes uses),
  else a multiple-choice letter match (when the record has `choices` or the
  gold is a single letter) or a normalised exact match; in [0, 1].
- format: 1 when the answer turn holds exactly one `<answer>...</answer>`.
- tool: 1 only when the answer is right (accuracy > 0.5) and at least one
  tool call succeeded, so zooming is rewarded only where it helped.

A judge that raises, or returns a non-`ok` RewardResult or a score outside
[0, 1], makes the whole reward 0.0 with that status and reason in `info`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image

from relax_gym.env.core import EpisodeOverError
from relax_gym.env.tool_env import ToolEnv
from relax_gym.envs.datasets import load_records, pick
from relax_gym.envs.deepeyes.data import IMAGE_PLACEHOLDER, data_file, load_image, task_from_record, validate
from relax_gym.envs.deepeyes.view import View, full_view, render, rotate, zoom
from relax_gym.messages import Message, Part, image, message, text
from relax_gym.rewards import (
    RewardResult,
    exact_match_reward,
    extract_tag,
    format_reward,
    multiple_choice_reward,
)
from relax_gym.tools import tool

Judge = Callable[[str, str, str], float | RewardResult]
BboxFormat = Literal["absolute", "normalized"]

_COORDINATES: dict[str, str] = {
    "absolute": "Coordinates are pixels of the latest image you were shown (the current view), "
    "origin at its top-left corner.",
    "normalized": "Coordinates run from 0 to 1000 across the width and height of the latest image you "
    "were shown (the current view), origin at its top-left corner.",
}

SYSTEM_PROMPT = """You answer questions about an image. Details may be too small to make out in the \
full image: look closer with the tools before answering.

- image_zoom_in(bbox_2d, label): shows the region bbox_2d = [x1, y1, x2, y2] of the current view \
enlarged. {coordinates} Zooming into a zoomed view narrows it further.
- image_rotate(angle): turns the current view by 90, 180 or 270 degrees counter-clockwise.

Call a tool as \
<tool_call>{{"name": "image_zoom_in", "arguments": {{"bbox_2d": [x1, y1, x2, y2]}}}}</tool_call>. You may \
think inside <think>...</think>. When you know the answer, reply without tool calls and put the short \
final answer (a word, a number or a letter) in <answer>...</answer>."""

_LETTER = re.compile(r"\(?[A-Za-z]\)?")


@dataclass(frozen=True)
class RewardWeights:
    accuracy: float
    format: float
    tool: float


class DeepEyesEnv(ToolEnv):
    """Visual search with zoom and rotate tools; answers graded by match or a pluggable judge.

    Args:
        data_path: a DeepEyes-47k style `.parquet` / `.jsonl` / `.json` file, or a folder
            holding `<split>.<ext>`; None uses the shipped synthetic data.
        split: which shipped (or folder) split to read.
        max_turns: assistant turns before the episode is truncated.
        bbox_format: "absolute" (pixels of the current view) or "normalized" (0-1000).
        acc_weight, format_weight, tool_weight: the reward weights (see the module docstring).
        judge: `judge(question, gold, prediction) -> float in [0, 1] | RewardResult`, replacing
            the built-in accuracy check.
        max_image_side: the longest side of any image shown; larger views are downscaled.
        min_image_side: smaller views (zooms, mostly) are upscaled until their short side
            reaches this, keeping the aspect ratio, so a VLM gets enough patches of a detail.
        max_tool_calls_per_turn, step_timeout_s: the per-turn bounds of `ToolEnv` (None keeps
            its defaults). The zoom and rotate tools build on the current view, so a turn's
            calls run one after another, in order.

    `reset(options={"index": i})` picks record i instead of a seeded random one.
    """

    metadata: dict[str, Any] = {**ToolEnv.metadata, "modalities": ("text", "image")}  # noqa: RUF012 (see Env.metadata)
    system_prompt: str  # always set by __init__ (it names the bbox format)

    def __init__(
        self,
        *,
        data_path: str | Path | None = None,
        split: str = "train",
        max_turns: int = 6,
        bbox_format: BboxFormat = "absolute",
        acc_weight: float = 1.0,
        format_weight: float = 0.1,
        tool_weight: float = 0.2,
        judge: Judge | None = None,
        max_image_side: int = 1344,
        min_image_side: int = 224,
        max_tool_calls_per_turn: int | None = None,
        step_timeout_s: float | None = None,
    ):
        if bbox_format not in _COORDINATES:
            raise ValueError(f"bbox_format must be 'absolute' or 'normalized', got {bbox_format!r}")
        if not 1 <= min_image_side <= max_image_side:
            raise ValueError(f"need 1 <= min_image_side <= max_image_side, got {min_image_side}, {max_image_side}")
        if not all(math.isfinite(w) for w in (acc_weight, format_weight, tool_weight)):
            raise ValueError("reward weights must be finite numbers")
        if judge is not None and not callable(judge):
            raise TypeError(f"judge must be callable(question, gold, prediction), got {type(judge).__name__}")
        super().__init__(
            max_turns=max_turns, max_tool_calls_per_turn=max_tool_calls_per_turn, step_timeout_s=step_timeout_s
        )
        self.source = data_file(data_path, split)
        self.records = load_records(self.source)
        validate(self.records, self.source)
        self.bbox_format = bbox_format
        self.weights = RewardWeights(acc_weight, format_weight, tool_weight)
        self.judge = judge
        self.max_image_side = max_image_side
        self.min_image_side = min_image_side
        self.system_prompt = SYSTEM_PROMPT.format(coordinates=_COORDINATES[bbox_format])
        self._image: Image.Image | None = None
        self._image_index: int | None = None

    # --- episode --------------------------------------------------------------------
    def new_task(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        if "index" in options:
            index = options["index"]
            if not isinstance(index, int | np.integer) or not 0 <= index < len(self.records):
                raise ValueError(f"options['index'] must be an int in [0, {len(self.records)}), got {index!r}")
            index = int(index)
        else:
            index, _ = pick(self.records, rng)
        task = task_from_record(self.records[index], index)
        self._load_image(index)
        return task

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        observation, _ = super().reset(seed=seed, options=options)
        self.episode["view"] = full_view(self._current_image())
        return observation, self._info()

    def prompt_messages(self, task: dict[str, Any]) -> list[Message]:
        """The system prompt, then the user text with the full image where its `<image>` placeholder was."""
        body = task["text"]
        before, _, after = body.partition(IMAGE_PLACEHOLDER) if IMAGE_PLACEHOLDER in body else ("", "", body)
        shown = self._render(full_view(self._current_image()))
        texts = (before.strip(), after.replace(IMAGE_PLACEHOLDER, "").strip())
        parts: list[Part | str] = [p for p in (texts[0], image(shown), texts[1]) if p]
        return [message("system", self.system_prompt), message("user", *parts)]

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self._load_image(self.episode["task"]["index"])

    def _load_image(self, index: int) -> None:
        if index != self._image_index:
            self._image = load_image(self.records[index], index, self.source)
            self._image_index = index

    def _current_image(self) -> Image.Image:
        if self._image is None:
            raise EpisodeOverError("no image loaded; call reset() first")
        return self._image

    def _render(self, view: View) -> Image.Image:
        return render(self._current_image(), view, self.min_image_side, self.max_image_side)

    def task_info(self, task: dict[str, Any]) -> dict[str, Any]:
        """The record, and the episode's current view and reward parts once there are any."""
        ep = self.episode
        ours: dict[str, Any] = {"record": task["index"]}
        if "view" in ep:
            ours["view"] = {"box": list(ep["view"]["box"]), "rotation": ep["view"]["rotation"]}
        if "reward_parts" in ep:
            ours["reward_parts"] = dict(ep["reward_parts"])
        return ours

    # --- tools ----------------------------------------------------------------------
    @tool
    def image_zoom_in(self, bbox_2d: list[float], label: str | None = None) -> list[Part]:
        """Zoom in on a region of the current view to see small details; the enlargement becomes the view.

        Args:
            bbox_2d: The region [x1, y1, x2, y2], top-left origin, in the coordinates the system prompt gives.
            label: Optional name of what the region contains, e.g. "the small red sign".
        """
        view = zoom(
            self.episode["view"],
            bbox_2d,
            normalized=self.bbox_format == "normalized",
            min_side=self.min_image_side,
            max_side=self.max_image_side,
        )
        return self._show(view, f"Zoomed in on {label}" if label else "Zoomed in")

    @tool
    def image_rotate(self, angle: int) -> list[Part]:
        """Rotate the current view counter-clockwise, e.g. to read sideways or upside-down text.

        Args:
            angle: Degrees counter-clockwise: 90, 180 or 270.
        """
        return self._show(rotate(self.episode["view"], angle), f"Rotated by {angle} degrees counter-clockwise")

    def scripted_actions(self) -> list[str]:
        """The `ScriptedEnv` hook (`relax-gym check`, benchmarks/env_step.py): a zoom, then an answer."""
        zoom = self.tool_format.write_calls([("image_zoom_in", {"bbox_2d": [100, 100, 400, 300]})])
        return [zoom, "<answer>red</answer>"]

    def _show(self, view: View, what: str) -> list[Part]:
        """Makes `view` current and returns it with a caption giving its place in the original image."""
        self.episode["view"] = view
        shown = self._render(view)
        turned = f", rotated {view['rotation']} degrees" if view["rotation"] else ""
        caption = (
            f"{what}. This view shows the original image's pixels {view['box']}{turned}, "
            f"displayed at {shown.width}x{shown.height}; further zooms use this view's coordinates."
        )
        return [text(caption), image(shown)]

    # --- reward ---------------------------------------------------------------------
    def grade(self, task: dict[str, Any], answer: str) -> RewardResult:
        tagged = extract_tag(answer)
        prediction = answer.strip() if tagged is None else tagged
        acc = self._judge(task, prediction) if self.judge else self._match(task, answer)
        if acc.status != "ok":
            return RewardResult(0.0, acc.status, acc.detail, acc.extracted or prediction)
        fmt = format_reward(answer, required_tags=("answer",))
        tool_bonus = float(acc.score > 0.5 and self.episode["tool_successes"] > 0)
        parts = {"accuracy": acc.score, "format": fmt.score, "tool": tool_bonus}
        self.episode["reward_parts"] = parts
        w = self.weights
        total = w.accuracy * acc.score + w.format * fmt.score + w.tool * tool_bonus
        notes = [acc.detail, fmt.detail and f"format: {fmt.detail}"]
        return RewardResult(total, "ok", "; ".join(n for n in notes if n) or None, acc.extracted or prediction)

    @staticmethod
    def _match(task: dict[str, Any], answer: str) -> RewardResult:
        gold = task["gold"]
        if task["choices"] or _LETTER.fullmatch(gold.strip()):
            return multiple_choice_reward(answer, gold, choices=task["choices"])
        return exact_match_reward(answer, gold)

    def _judge(self, task: dict[str, Any], prediction: str) -> RewardResult:
        """Calls the judge; any failure becomes an `error` result naming the reason."""
        try:
            verdict = self.judge(task["question"], task["gold"], prediction)  # type: ignore[misc]
        except Exception as err:  # a judge is user code (often a network call): report, never crash
            return RewardResult(0.0, "error", f"judge raised {type(err).__name__}: {err}", prediction)
        if isinstance(verdict, RewardResult):
            return verdict
        try:
            value = float(verdict)
        except (TypeError, ValueError):
            return RewardResult(0.0, "error", f"judge returned {verdict!r}, not a number", prediction)
        if not 0.0 <= value <= 1.0:
            return RewardResult(0.0, "error", f"judge returned {value}, outside [0, 1]", prediction)
        return RewardResult(value, "ok", None, prediction)
