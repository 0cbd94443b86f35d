"""AudioQA: single-turn multiple-choice questions about one or more audio clips.

The shipped data (`data/audioqa/`, made by `scripts/make_audioqa_data.py`) is
synthesised tones whose answers follow from the signal, so it runs anywhere
with no download. Users point `data_path` at their own AVQA-style jsonl/parquet
(clips as paths relative to the file, bytes, or decoded arrays). Clips are
decoded on first use and kept in a per-env LRU cache bounded in bytes, so a
40k-clip dataset costs memory only for the clips recently served.
"""

from __future__ import annotations

import string
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relax_gym.env.core import Env, StepResult
from relax_gym.env.single_turn import SingleTurnEnv
from relax_gym.envs.audio_io import AudioSource, load_audio, resample, valid_rate
from relax_gym.envs.datasets import DatasetError, load_records, record_index, require_gold, shipped_path
from relax_gym.messages import Message, Part, audio, message, text
from relax_gym.rewards import RewardResult, multiple_choice_reward

LETTERS = string.ascii_uppercase
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
INSTRUCTION = "Answer with the letter of the correct option inside <answer></answer>, e.g. <answer>A</answer>."

# Field names accepted for each part of a record: ours first, then AVQA's (as in R1-AQA's jsonl).
FIELDS: dict[str, tuple[str, ...]] = {
    "audio": ("audio", "audio_path", "audios"),
    "question": ("question", "question_text"),
    "choices": ("choices", "multi_choice", "options"),
    "answer": ("answer",),
}


@dataclass(frozen=True)
class AudioQATask:
    """One validated record: its clips (still encoded), the question and the gold letter."""

    id: str
    clips: tuple[AudioSource, ...]
    question: str
    choices: tuple[str, ...]
    answer: str
    task: str


class ClipCache:
    """Decoded waveforms, least recently used evicted first once `max_bytes` is exceeded."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[Any, tuple[np.ndarray, int]] = OrderedDict()

    def get(self, key: Any) -> tuple[np.ndarray, int] | None:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        return None

    def put(self, key: Any, value: tuple[np.ndarray, int]) -> None:
        self._items[key] = value
        self.nbytes += value[0].nbytes
        while self.nbytes > self.max_bytes and len(self._items) > 1:
            _, (old, _) = self._items.popitem(last=False)
            self.nbytes -= old.nbytes

    def __len__(self) -> int:
        return len(self._items)


class AudioQAEnv(SingleTurnEnv):
    """Listen to the clip(s), pick the lettered option; reward 1 for the right letter in <answer></answer>."""

    metadata: dict[str, Any] = {**Env.metadata, "modalities": ("text", "audio")}  # noqa: RUF012 (see Env.metadata)

    def __init__(
        self,
        data_path: str | Path | None = None,
        split: str = "train",
        system_prompt: str | None = None,
        target_sampling_rate: int | None = None,
        cache_mb: float = 128.0,
    ):
        if target_sampling_rate is not None and not valid_rate(target_sampling_rate):
            raise ValueError(f"target_sampling_rate must be a positive int or None: {target_sampling_rate!r}")
        super().__init__()
        self.system_prompt = system_prompt
        self.target_sampling_rate = target_sampling_rate
        self.data_file = _data_file(data_path, split)
        self.tasks: tuple[AudioQATask, ...] = tuple(
            parse_record(r, i, self.data_file) for i, r in enumerate(load_records(self.data_file))
        )
        if not self.tasks:
            raise DatasetError(f"{self.data_file}: the dataset is empty")
        self.cache = ClipCache(int(cache_mb * 2**20))

    # --- episode ------------------------------------------------------------------
    def new_task(self, rng: np.random.Generator, options: dict[str, Any]) -> int:
        """A record index: `options["index"]` when given, else a seeded draw."""
        return record_index(options, len(self.tasks), rng)

    def grade(self, task: int, answer: str) -> RewardResult:
        record = self.tasks[task]
        return multiple_choice_reward(answer, record.answer, choices=record.choices)

    def task_info(self, task: int) -> dict[str, Any]:
        record = self.tasks[task]
        return {"id": record.id, "task": record.task, "index": task, "num_clips": len(record.clips)}

    def scripted_actions(self) -> list[str]:
        """The `ScriptedEnv` hook (`relax-gym check`, benchmarks/env_step.py): one choice."""
        return ["<answer>A</answer>"]

    def step(self, action: str) -> StepResult:
        observation, reward, terminated, truncated, info = super().step(action)
        return observation, reward, terminated, truncated, {**info, "answer": self.tasks[self.task].answer}

    def set_state(self, state: dict[str, Any]) -> None:
        """Refuses a snapshot of a record this env's dataset lacks (taken on another data file)."""
        index = state["episode"].get("task")
        if index is not None and not 0 <= index < len(self.tasks):
            raise ValueError(f"state index {index} is outside this dataset's {len(self.tasks)} records")
        super().set_state(state)

    # --- prompt -------------------------------------------------------------------
    def prompt_messages(self, index: int) -> list[Message]:
        """The prompt of record `index`, with fresh copies of its waveforms."""
        task = self.tasks[index]
        parts: list[Part | str] = []
        for j in range(len(task.clips)):
            if len(task.clips) > 1:
                parts.append(f"Clip {j + 1}:")
            samples, rate = self.clip(index, j)
            parts.append(audio(samples.copy(), rate))
        parts.append(text(question_text(task)))
        head = [message("system", self.system_prompt)] if self.system_prompt else []
        return [*head, message("user", *parts)]

    def clip(self, index: int, j: int) -> tuple[np.ndarray, int]:
        """Clip `j` of record `index`, decoded (and resampled) once, then served from the cache.

        The returned array is the cached one: copy it before handing it out.
        """
        source = self.tasks[index].clips[j]
        key = str(source) if isinstance(source, str | Path) else (index, j)
        cached = self.cache.get(key)
        if cached is None:
            name = f"{self.data_file} record {index} (id {self.tasks[index].id!r}) clip {j + 1}"
            samples, rate = load_audio(source, base_dir=self.data_file.parent, name=name)
            if self.target_sampling_rate is not None and rate != self.target_sampling_rate:
                samples, rate = resample(samples, rate, self.target_sampling_rate), self.target_sampling_rate
            cached = (samples, rate)
            self.cache.put(key, cached)
        return cached


def question_text(task: AudioQATask) -> str:
    options = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(task.choices))
    return f"{task.question}\n{options}\n{INSTRUCTION}"


def _data_file(data_path: str | Path | None, split: str) -> Path:
    """The records file: `data_path` itself, `<data_path>/<split>.<ext>`, or the shipped split."""
    folder = shipped_path("audioqa") if data_path is None else Path(data_path).expanduser()
    if not folder.is_dir():
        return folder  # a file (load_records says if it is missing)
    for suffix in DATA_SUFFIXES:
        if (folder / f"{split}{suffix}").is_file():
            return folder / f"{split}{suffix}"
    found = sorted(p.name for p in folder.iterdir() if p.suffix in DATA_SUFFIXES)
    raise DatasetError(f"no {split!r} split in {folder}: expected {split}.jsonl/.json/.parquet, has {found}")


def _field(record: Mapping[str, Any], key: str, where: str) -> Any:
    for name in FIELDS[key]:
        if record.get(name) is not None:
            return record[name]
    raise DatasetError(f"{where}: record lacks {key!r} (accepted as {FIELDS[key]}); it has {sorted(record)}")


def parse_record(record: Mapping[str, Any], index: int, data_file: Path) -> AudioQATask:
    """Validates one record up front so a malformed dataset fails at construction, not mid-training."""
    if not isinstance(record, Mapping):
        raise DatasetError(f"{data_file} record {index}: expected an object, got {type(record).__name__}")
    where = f"{data_file} record {index} (id {record.get('id', index)!r})"
    question = _field(record, "question", where)
    choices = _field(record, "choices", where)
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{where}: 'question' must be a non-empty string")
    if not isinstance(choices, Sequence) or isinstance(choices, str) or not 2 <= len(choices) <= len(LETTERS):
        raise DatasetError(f"{where}: 'choices' must be a list of 2 to {len(LETTERS)} option texts")
    choices = tuple(str(c) for c in choices)
    return AudioQATask(
        id=str(record.get("id", index)),
        clips=_clips(_field(record, "audio", where), where),
        question=question.strip(),
        choices=choices,
        answer=answer_letter(require_gold(_field(record, "answer", where), where, "answer"), choices, where),
        task=str(record.get("task") or record.get("question_type") or "audio_qa"),
    )


def _clips(value: Any, where: str) -> tuple[AudioSource, ...]:
    """One source or a list of them (multi-clip questions), in prompt order."""
    clips = tuple(value) if isinstance(value, list | tuple) else (value,)
    if not clips:
        raise DatasetError(f"{where}: 'audio' is an empty list")
    for clip in clips:
        if not isinstance(clip, str | bytes | Mapping) or (isinstance(clip, str) and not clip.strip()):
            raise DatasetError(f"{where}: audio must be a path, bytes or dict, not {type(clip).__name__}")
    return clips


def answer_letter(answer: Any, choices: Sequence[str], where: str) -> str:
    """The gold letter from a letter ("B", "(B)"), a 0-based index (1, 1.0, "1") or the option's text.

    A whole float is an index: pandas stores an int column with a missing value as floats.
    """
    if isinstance(answer, float | np.floating) and answer.is_integer():
        answer = int(answer)
    if isinstance(answer, int | np.integer) and not isinstance(answer, bool):
        if 0 <= answer < len(choices):
            return LETTERS[int(answer)]
        raise DatasetError(f"{where}: answer index {answer} is outside the {len(choices)} choices")
    if isinstance(answer, str):
        stripped = answer.strip()
        letter = stripped.strip("().").upper()
        if len(letter) == 1 and letter in LETTERS[: len(choices)] and len(stripped) <= 3:
            return letter
        matches = [i for i, c in enumerate(choices) if c.strip().casefold() == stripped.casefold()]
        if len(matches) == 1:
            return LETTERS[matches[0]]
        if stripped.isdigit() and int(stripped) < len(choices):
            return LETTERS[int(stripped)]
    raise DatasetError(f"{where}: answer {answer!r} is no letter, 0-based index or option of {list(choices)}")
