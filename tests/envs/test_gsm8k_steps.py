"""relax/GSM8KSteps-v0: GSM8K's calculator annotations as tool tasks, on the shipped rows."""

from __future__ import annotations

import asyncio
import runpy
from pathlib import Path

import pytest

import relax_gym
from relax_gym.envs.datasets import DatasetError, load_records, shipped_path
from relax_gym.envs.gsm8k_steps import _checked, arithmetic, load_steps, steps_of
from relax_gym.models import load_model
from relax_gym.trajectory import read_jsonl

pytestmark = pytest.mark.filterwarnings("ignore::relax_gym.sandbox.SandboxFallbackWarning")
ROOT = Path(__file__).resolve().parents[2]

#: a walkthrough as GSM8K writes them: two annotations on one line, one whose result is not repeated after it
ROW = {"id": "r", "question": "Tom has 3 bags of 4 apples and eats 2. How many are left?",
       "answer": "He had 3*4 = <<3*4=12>>12 apples and 12-2=<<12-2=10>>10 were left\nThat is <<10*1=10>> in all.\n"
                 "#### 10"}


def test_each_annotation_is_a_step_whose_line_hides_its_result_and_shows_the_others():
    steps = steps_of(ROW)
    assert [(s.expression, s.result) for s in steps] == [("3*4", "12"), ("12-2", "10"), ("10*1", "10")]
    assert [s.line for s in steps] == ["He had 3*4 = ? apples and 12-2=10 were left",
                                       "He had 3*4 = 12 apples and 12-2=? were left", "That is ? in all."]
    assert {s.question for s in steps} == {ROW["question"]}


def test_the_shipped_rows_give_224_training_and_100_held_out_steps_each_answerable_by_its_expression():
    train, test = load_steps("train"), load_steps("test")
    assert (len(train), len(test)) == (224, 100)
    test_rows = {r["id"] for r in load_records(shipped_path("gsm8k", "test.jsonl"))}
    held_out = {s.row_id for s in test}  # one held-out row (gsm8k-test-0946) has no annotation, so no step
    assert held_out <= test_rows and len(held_out) == 29 and not {s.row_id for s in train} & test_rows
    assert all("?" in s.line and "<<" not in s.line for s in train + test)
    with pytest.raises(DatasetError, match=r"'2\+2' evaluates to 4, not 5"):
        _checked(steps_of({"id": "x", "question": "q", "answer": "2+2=<<2+2=5>>5"})[0], "here")
    assert arithmetic("(1,000-2^3)/4") == 248.0
    with pytest.raises(ValueError, match="not arithmetic"):
        arithmetic("__import__('os').getcwd()")


def test_an_episode_runs_the_expression_with_the_tool_then_grades_the_boxed_answer():
    env = relax_gym.make("relax/GSM8KSteps-v0", split="test", sandbox_timeout_s=10.0)
    obs, info = env.reset(seed=0, options={"index": 5})
    step = env.unwrapped.steps[5]
    assert (info["task_index"], info["expression"], info["row_id"]) == (5, step.expression, step.row_id)
    text = obs[-1]["content"][0]["text"]
    assert text.startswith(step.question) and step.line in text and "python tool" in text
    obs, reward, terminated, _, step_info = env.step(f"```python\nprint({step.expression})\n```")
    assert (reward, terminated, step_info["tool_calls"]) == (0.0, False, 1)
    printed = obs[0]["content"][0]["text"].split("stdout:")[1].split()[0]
    _, reward, terminated, _, _ = env.step(f"\\boxed{{{printed}}}")
    assert (reward, terminated) == (1.0, True)
    env.close()
    with pytest.raises(TypeError, match="no data_path"):
        relax_gym.make("relax/GSM8KSteps-v0", data_path="mine.jsonl")
    with pytest.raises(ValueError, match="split"):
        relax_gym.make("relax/GSM8KSteps-v0", split="dev")


def test_the_oracle_demonstrations_solve_every_step_they_play(tmp_path):
    """examples/gsm8k_steps_demos.py, as `relax-gym sft` gets it: each demonstration runs the step's expression,
    answers what the tool printed, and is right."""
    demos = runpy.run_path(str(ROOT / "examples" / "gsm8k_steps_demos.py"))
    out = tmp_path / "demos.jsonl"
    assert asyncio.run(demos["demonstrations"](load_model("tiny"), 6, out)) == 6
    played = list(read_jsonl(out))
    assert all(t.metrics["tool_calls"] == 1 and t.reward == 1.0 for t in played)
