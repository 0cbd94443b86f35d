"""AVQA: multiple-choice questions about an image and an audio clip together.

Without `data_path`, each task is drawn from the reset seed: a picture of some coloured shapes and a clip of
beeps, and a question whose options differ in what the picture shows and in what the clip sounds like, so only
a model that uses both gets it right (known by construction; nothing ships, nothing downloads).

With `data_path`, the records are the user's, in AVQA-R1-6K's layout (EchoInk-R1's JSON: `problem`, `options`
as "A. text", `solution` as "<answer>A</answer>", `path: {image, audio}` relative to the file) or the plain
one (`question`, `choices`, `answer`, `image`, `audio`); .json, .jsonl or .parquet. Images and clips are read
when an episode needs them and every bad one is a DatasetError naming the record and the file.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from relax_gym.env.core import Env
from relax_gym.env.single_turn import SingleTurnEnv
from relax_gym.envs.audio_io import AudioSource, load_audio
from relax_gym.envs.audio_qa import DATA_SUFFIXES, answer_letter
from relax_gym.envs.datasets import DatasetError, load_records, read_image, record_index, require_gold
from relax_gym.messages import Message, audio, image, message, text
from relax_gym.rewards import RewardResult, multiple_choice_reward

LETTERS = string.ascii_uppercase
INSTRUCTION = "Answer with the letter of the correct option inside <answer></answer>, e.g. <answer>A</answer>."
SHAPE_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30),
}
RATE = 16_000
#: "A. text", "(A) text", "A) text": an option that carries its own letter
_LETTERED = re.compile(r"^\s*\(?([A-Z])[.)]\s+")


@dataclass(frozen=True)
class AVQATask:
    """One question: its image and clip (drawn, or still encoded in the user's file), options and gold letter."""

    id: str
    question: str
    choices: tuple[str, ...]
    answer: str
    image: Any = None
    audio: Any = None


class AVQAEnv(SingleTurnEnv):
    """Look at the image and listen to the clip, pick the lettered option; reward 1 for the right letter."""

    metadata: dict[str, Any] = {**Env.metadata, "modalities": ("text", "image", "audio")}  # noqa: RUF012

    def __init__(self, data_path: str | Path | None = None, split: str = "train", system_prompt: str | None = None):
        super().__init__()
        self.system_prompt = system_prompt
        self.data_file = None if data_path is None else _data_file(Path(data_path).expanduser(), split)
        self.tasks: tuple[AVQATask, ...] = ()
        if self.data_file is not None:
            records = load_records(self.data_file)
            self.tasks = tuple(parse_record(r, i, self.data_file) for i, r in enumerate(records))
            if not self.tasks:
                raise DatasetError(f"{self.data_file}: the dataset is empty")

    # --- episode ------------------------------------------------------------------
    def new_task(self, rng: np.random.Generator, options: dict[str, Any]) -> AVQATask | int:
        """A record index (user data: `options["index"]` or a seeded draw), else a drawn task."""
        return record_index(options, len(self.tasks), rng) if self.tasks else drawn_task(rng)

    def record(self, task: AVQATask | int) -> AVQATask:
        return self.tasks[task] if isinstance(task, int) else task

    def prompt_messages(self, task: AVQATask | int) -> list[Message]:
        record = self.record(task)
        where = f"{self.data_file} record {task} (id {record.id!r})"
        base = self.data_file.parent if self.data_file is not None else Path(".")
        picture = record.image if isinstance(record.image, Image.Image) else read_image(record.image, base, where)
        if isinstance(record.audio, tuple):
            samples, rate = record.audio
        else:
            samples, rate = load_audio(record.audio, base_dir=base, name=f"{where} audio")
        options = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(record.choices))
        head = [message("system", self.system_prompt)] if self.system_prompt else []
        return [*head, message("user", image(picture), audio(np.array(samples, np.float32), rate),
                               text(f"{record.question}\n{options}\n{INSTRUCTION}"))]

    def grade(self, task: AVQATask | int, answer: str) -> RewardResult:
        record = self.record(task)
        return multiple_choice_reward(answer, record.answer, choices=record.choices)

    def task_info(self, task: AVQATask | int) -> dict[str, Any]:
        record = self.record(task)
        return {"id": record.id, "answer": record.answer, **({"index": task} if isinstance(task, int) else {})}


def drawn_task(rng: np.random.Generator) -> AVQATask:
    """`shapes` squares of one colour in a picture, `beeps` short tones in a clip; the options cross a colour and
    a count, so the right one needs both the picture and the sound."""
    colours = list(SHAPE_COLOURS)
    colour = colours[int(rng.integers(len(colours)))]
    beeps, shapes = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    picture = Image.new("RGB", (96, 64), (245, 245, 245))
    draw = ImageDraw.Draw(picture)
    for i in range(shapes):
        draw.rectangle((8 + 28 * i, 20, 30 + 28 * i, 42), fill=SHAPE_COLOURS[colour])
    clip = np.zeros(RATE * 2, np.float32)
    for i in range(beeps):
        start = int(RATE * (0.1 + 0.6 * i))
        t = np.arange(int(RATE * 0.25)) / RATE
        clip[start: start + len(t)] = 0.4 * np.sin(2 * np.pi * 880 * t)
    other_colour = colours[(colours.index(colour) + 1 + int(rng.integers(len(colours) - 1))) % len(colours)]
    other_beeps = 1 + (beeps - 1 + int(rng.integers(1, 3))) % 3  # another of 1..3
    right = f"{colour} shapes, {beeps} beep{'s' * (beeps > 1)}"
    wrong = [f"{c} shapes, {b} beep{'s' * (b > 1)}" for c, b in ((colour, other_beeps), (other_colour, beeps),
                                                                  (other_colour, other_beeps))]
    order = rng.permutation(4)
    choices = [([right, *wrong])[i] for i in order]
    return AVQATask(id=f"drawn-{colour}-{shapes}-{beeps}", question="What colour are the shapes in the picture, "
                    "and how many beeps are in the sound?", choices=tuple(choices),
                    answer=LETTERS[int(np.flatnonzero(order == 0)[0])], image=picture, audio=(clip, RATE))


def _data_file(path: Path, split: str) -> Path:
    """The records file: `path` itself, or `<path>/<split>.<ext>` (AVQA-R1-6K's `omni_rl_format_<split>.json`)."""
    if not path.is_dir():
        return path
    names = [f"{split}{suffix}" for suffix in DATA_SUFFIXES] + [f"omni_rl_format_{split}.json"]
    for candidate in (path / n for n in names):
        if candidate.is_file():
            return candidate
    raise DatasetError(f"no {split!r} split in {path}: expected one of {names}")


def parse_record(record: Mapping[str, Any], index: int, data_file: Path) -> AVQATask:
    """One record, validated up front (its image and clip are read when an episode needs them)."""
    if not isinstance(record, Mapping):
        raise DatasetError(f"{data_file} record {index}: expected an object, got {type(record).__name__}")
    rid = record.get("problem_id", record.get("id", index))
    where = f"{data_file} record {index} (id {rid!r})"
    question = record.get("problem") or record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{where}: needs a non-empty 'problem' (or 'question')")
    raw = record.get("options") or record.get("choices")
    if not isinstance(raw, Sequence) or isinstance(raw, str) or not 2 <= len(raw) <= len(LETTERS):
        raise DatasetError(f"{where}: 'options' (or 'choices') must be a list of 2 to {len(LETTERS)} options")
    choices = tuple(_LETTERED.sub("", str(c), count=1) for c in raw)
    gold = record.get("solution") if record.get("solution") is not None else record.get("answer")
    gold = require_gold(gold, where, "solution")
    if isinstance(gold, str) and (tagged := re.search(r"<answer>\s*(.*?)\s*</answer>", gold, re.S)):
        gold = tagged.group(1)
    nested = record.get("path")
    paths: Mapping[str, Any] = nested if isinstance(nested, Mapping) else record
    image_source, audio_source = paths.get("image"), paths.get("audio")
    if image_source is None or audio_source is None:
        raise DatasetError(f"{where}: needs an image and an audio clip ('path': {{'image', 'audio'}}, or "
                           "'image' and 'audio')")
    return AVQATask(id=str(rid), question=question.strip(), choices=choices,
                    answer=answer_letter(gold, choices, where), image=image_source,
                    audio=_audio_source(audio_source, where))


def _audio_source(value: Any, where: str) -> AudioSource:
    if not isinstance(value, str | bytes | Mapping) or (isinstance(value, str) and not value.strip()):
        raise DatasetError(f"{where}: audio must be a path, bytes or dict, not {type(value).__name__}")
    return value
