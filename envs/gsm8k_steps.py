"""GSM8K's own calculator steps as tool tasks: `relax/GSM8KSteps-v0`.

GSM8K's annotators marked each calculation of a worked solution as `<<48/2=24>>`, the calls their calculator
made. Each such step of the shipped rows (`envs/data/gsm8k/`, real GSM8K test rows, MIT) is a task
here: the question, then the step's line of the walkthrough with its result left out ("So he went 3*10=? miles"),
to be worked out with the sandboxed `python` tool and answered in \\boxed{}. Graded against the annotation's
result. The 70 training rows give 224 steps, the 30 held out 100, and every annotation's expression evaluates to
its result (checked when the steps are read), so each task is answerable by running its expression.

Why steps and not whole rows: a small model (SmolLM2-135M, the laptop's) solves no GSM8K row end to end, so RL
there has no signal (docs/envs.md measures it); a step keeps the real text and the real arithmetic, which such a
model gets wrong in its head, while the skill RL shapes is the agentic one: call the tool with the step's
expression, read the answer back, answer it.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

from relax_gym.envs.datasets import DatasetError, load_records, shipped_path
from relax_gym.envs.math import MathTask, MathToolEnv, Split

#: a calculator annotation: `<<expression=result>>`
ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>=]+)>>")
#: the step's question, after the problem
ASK = ("One line of its worked solution, with the result of its calculation left out:\n{line}\n\n"
       "Work out the number that goes where the ? is with the python tool, then answer it within \\boxed{{}}.")


@dataclass(frozen=True)
class Step:
    """One calculation of one row's walkthrough."""

    row_id: str
    question: str
    line: str  # the walkthrough's line, this step's result shown as ? and the others' annotations dropped
    expression: str
    result: str


def steps_of(row: dict[str, Any]) -> list[Step]:
    """The steps of one GSM8K row (`id`, `question`, `answer` with `<<...>>` annotations), in order."""
    steps = []
    for line in str(row["answer"]).split("\n"):
        if line.startswith("####"):
            continue
        for found in ANNOTATION.finditer(line):
            expression, result = found.group(1).strip(), found.group(2).strip()
            shown = line[found.end():]
            shown = "?" + (shown[len(result):] if shown.startswith(result) else shown)
            masked = ANNOTATION.sub("", line[:found.start()]) + shown
            steps.append(Step(str(row["id"]), str(row["question"]).strip(), ANNOTATION.sub("", masked), expression,
                              result))
    return steps


_OPERATORS: dict[type, Callable[..., float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow, ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv, ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def arithmetic(expression: str) -> float:
    """The value of an annotation's arithmetic (numbers, + - * / ** % // and brackets; `^` is GSM8K's power):
    read by walking its syntax tree, so no text of a data file is ever run as code."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"{ast.unparse(node)!r} is not arithmetic")

    return value(ast.parse(expression.replace("^", "**").replace(",", ""), mode="eval").body)


def _checked(step: Step, where: str) -> Step:
    """The step, if its expression evaluates to its result: a task the tool cannot answer is a data error."""
    try:
        found = arithmetic(step.expression)
        right = abs(found - float(step.result.replace(",", ""))) < 1e-6
    except (SyntaxError, ValueError, ArithmeticError) as err:  # a malformed annotation
        raise DatasetError(f"{where}: step {step.expression!r} does not evaluate ({err})") from err
    if not right:
        raise DatasetError(f"{where}: step {step.expression!r} evaluates to {found:g}, not {step.result}")
    return step


def load_steps(split: Split) -> list[Step]:
    """Every step of the shipped split's rows, each checked."""
    path = shipped_path("gsm8k", f"{split}.jsonl")
    return [_checked(step, f"{path}: row {row.get('id')}") for row in load_records(path) for step in steps_of(row)]


class GSM8KStepsEnv(MathToolEnv):
    """One calculator step of a real GSM8K walkthrough, worked out with the sandboxed `python` tool.

    `split` picks the shipped rows' steps: 224 of the 70 training rows, 100 of the 30 held out. The prompt
    is the row's question and the step's line; `reset(options={"index": i})` poses step i. Code fences are read
    as `python` calls, as `relax/GSM8K-v0` reads them.
    """

    def __init__(self, split: Split = "train", *, code_fences: bool = True, **kwargs: Any):
        if "data_path" in kwargs:
            raise TypeError("relax/GSM8KSteps-v0 reads the shipped GSM8K rows' steps; it takes no data_path")
        if split not in get_args(Split):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        self.steps = load_steps(split)
        super().__init__(data_path=shipped_path("gsm8k", f"{split}.jsonl"), split=split, code_fences=code_fences,
                         **kwargs)
        self.tasks = [MathTask((("user", f"{s.question}\n\n{ASK.format(line=s.line)}"),), s.result, i)
                      for i, s in enumerate(self.steps)]

    def task_info(self, task: MathTask) -> dict[str, Any]:
        step = self.steps[task.index]
        return {"task_index": task.index, "row_id": step.row_id, "expression": step.expression}
