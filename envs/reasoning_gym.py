"""Any reasoning-gym dataset as a single-turn env, scored by the dataset's own `score_answer`.

reasoning-gym (https://github.com/open-thought/reasoning-gym) generates ~100
families of verifiable puzzles procedurally; wrapping it by name gives all of
them without a copy of their generators or graders here. It is an optional
extra, imported when the env is made, not when the id is listed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from types import ModuleType
from typing import Any

import numpy as np

from relax_gym.env.core import Env
from relax_gym.env.single_turn import SingleTurnEnv
from relax_gym.messages import Message, message
from relax_gym.rewards import RewardResult, extract_tag

INSTALL_HINT = "pip install 'relax-gym[reasoning-gym]'"


def import_reasoning_gym() -> ModuleType:
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError(f"relax/ReasoningGym-v0 needs the reasoning-gym package: {INSTALL_HINT}") from err
    return reasoning_gym


def create_dataset(rg: ModuleType, name: str, size: int, seed: int, config: dict[str, Any]) -> Any:
    """`reasoning_gym.create_dataset`, with errors that name the valid choices."""
    datasets = rg.factory.DATASETS
    if name not in datasets:
        close = difflib.get_close_matches(name, list(datasets), n=3)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"reasoning-gym has no dataset {name!r}.{hint} It has: {', '.join(sorted(datasets))}")
    try:
        return rg.create_dataset(name, size=size, seed=seed, **config)
    except (TypeError, ValueError, AssertionError) as err:  # config dataclass / its validate()
        fields = [f.name for f in dataclasses.fields(datasets[name][1]) if f.name not in ("size", "seed")]
        raise ValueError(
            f"reasoning-gym dataset {name!r} rejected config {config}: {err or type(err).__name__}. "
            f"Its config fields: {', '.join(fields)}"
        ) from err


class ReasoningGymEnv(SingleTurnEnv):
    """A reasoning-gym dataset by name; answer in <answer></answer>, scored by reasoning-gym.

    Extra kwargs go to the dataset's config class (e.g. `min_animals=2`).
    `system_prompt=None` uses reasoning-gym's default prompt, which asks for
    <answer> tags; "" sends no system message.
    """

    metadata: dict[str, Any] = {**Env.metadata, "modalities": ("text",)}  # noqa: RUF012 (see Env.metadata)

    def __init__(
        self,
        dataset: str = "leg_counting",
        size: int = 1000,
        dataset_seed: int = 0,
        system_prompt: str | None = None,
        **config: Any,
    ):
        rg = import_reasoning_gym()
        self.dataset_name = dataset
        self.dataset = create_dataset(rg, dataset, size, dataset_seed, config)
        self.system_prompt = rg.utils.SYSTEM_PROMPTS["default"] if system_prompt is None else system_prompt
        super().__init__()

    def new_task(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        index = int(rng.integers(len(self.dataset)))
        return {"index": index, "entry": self.dataset[index]}

    def prompt_messages(self, task: dict[str, Any]) -> list[Message]:
        system = [message("system", self.system_prompt)] if self.system_prompt else []
        return [*system, message("user", task["entry"]["question"])]

    def grade(self, task: dict[str, Any], answer: str) -> RewardResult:
        """The last <answer> block (else the whole reply), graded by the dataset; a grader crash is an error."""
        tagged = extract_tag(answer, "answer")
        given = answer.strip() if tagged is None else tagged
        try:
            score = float(self.dataset.score_answer(given, task["entry"]))
        except Exception as err:  # third-party graders raise anything on odd input
            return RewardResult(0.0, "error", f"score_answer raised {type(err).__name__}: {err}", given[:200])
        if not math.isfinite(score):
            return RewardResult(0.0, "error", f"score_answer returned {score}", given[:200])
        detail = None if tagged is not None else "no <answer> tag; graded the whole reply"
        return RewardResult(score, detail=detail, extracted=given[:200])

    def scripted_actions(self) -> list[str]:
        """The `ScriptedEnv` hook (`relax-gym check`, benchmarks/env_step.py): one tagged answer."""
        return ["<answer>4</answer>"]

    def task_info(self, task: dict[str, Any]) -> dict[str, Any]:
        source = (task["entry"].get("metadata") or {}).get("source_dataset", self.dataset_name)
        return {"dataset": self.dataset_name, "source_dataset": str(source), "index": task["index"]}
