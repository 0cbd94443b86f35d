"""JudgedQA: open questions graded by a judge model (GenRM), for answers no rule can check.

Each task is a question with a reference answer; the reply's score is `JudgeReward`'s: a second model
(`judge: {url: ...}`: any OpenAI-compatible server, e.g. `relax-gym serve --model M`) reads the question, the
reference and the reply and gives 0..10, scaled to 0..1. A judge that times out or fails makes the step's
reward record say `timeout` or `error` (the trajectory's `metrics.reward_status`), never a silent 0.

The shipped questions are a small built-in set; `data_path` reads the user's .jsonl / .json / .parquet with
`question` and `reference` (or `answer`) fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from relax_gym.env.core import Env
from relax_gym.env.single_turn import SingleTurnEnv
from relax_gym.envs.datasets import DatasetError, load_records, record_index, require_gold
from relax_gym.rewards import RewardResult
from relax_gym.rewards.judge import JudgeReward, shared_judge

QUESTIONS: tuple[tuple[str, str], ...] = (
    ("Why is the sky blue on a clear day?", "Air molecules scatter short (blue) wavelengths of sunlight more "
     "than long ones (Rayleigh scattering), so blue light reaches the eye from every direction."),
    ("What does a thermometer measure?", "Temperature."),
    ("Why do we have seasons on Earth?", "Earth's axis is tilted, so each hemisphere gets more direct sunlight "
     "for part of the year."),
    ("What is the main job of the heart?", "To pump blood through the body."),
    ("Why does ice float on water?", "Ice is less dense than liquid water."),
    ("What is photosynthesis?", "Plants using light to turn carbon dioxide and water into sugar and oxygen."),
    ("Name a renewable source of energy.", "Any of solar, wind, hydro, geothermal or biomass."),
    ("What causes tides?", "Mainly the Moon's gravity (and the Sun's) pulling on Earth's oceans."),
)


class JudgedQAEnv(SingleTurnEnv):
    """Answer an open question; a judge model scores the answer against a reference."""

    metadata: dict[str, Any] = {**Env.metadata}  # noqa: RUF012 (see Env.metadata)
    blocking = True  # grading waits on the judge: steps run in worker threads

    def __init__(self, judge: dict[str, Any] | JudgeReward | None = None, data_path: str | Path | None = None,
                 system_prompt: str | None = None):
        """`judge`: a `JudgeReward`, or its keyword arguments (`url`, `model_name`, `template`, `timeout_s`,
        `retries`, ...) as a config gives them."""
        super().__init__()
        if judge is None:
            raise ValueError("relax/JudgedQA-v0 needs a judge: judge={url: http://HOST:PORT} (an OpenAI-compatible "
                             "server, e.g. `relax-gym serve --model M`)")
        self.judge = judge if isinstance(judge, JudgeReward) else shared_judge(**judge)
        self.judge.probe()  # a wrong URL or key stops `relax-gym train` and `check` at start-up
        self.system_prompt = system_prompt
        self.tasks = QUESTIONS if data_path is None else _records(Path(data_path).expanduser())

    def new_task(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        index = record_index(options, len(self.tasks), rng)
        question, reference = self.tasks[index]
        return {"index": index, "prompt": question, "reference": reference}

    def grade(self, task: dict[str, Any], answer: str) -> RewardResult:
        return self.judge(task["prompt"], answer, task["reference"])

    def task_info(self, task: dict[str, Any]) -> dict[str, Any]:
        return {"index": task["index"]}


def _records(path: Path) -> tuple[tuple[str, str], ...]:
    out = []
    for i, record in enumerate(load_records(path)):
        where = f"{path} record {i}"
        question = record.get("question") or record.get("prompt")
        if not isinstance(question, str) or not question.strip():
            raise DatasetError(f"{where}: needs a non-empty 'question'")
        reference = record.get("reference", record.get("answer"))
        out.append((question.strip(), str(require_gold(reference, where, "reference"))))
    if not out:
        raise DatasetError(f"{path}: the dataset is empty")
    return tuple(out)
