"""Procedurally generated tasks: unlimited, seeded, with difficulty as kwargs.

Every task is drawn from `self.np_random` alone, so a seed names an episode,
and answers are short integers or expressions: a tiny model on a CPU can
learn them, which makes these the envs for smoke-testing a training loop.
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter, deque
from fractions import Fraction
from typing import Any, Literal

import numpy as np

from relax_gym.env.core import Env, EpisodeState, StepResult
from relax_gym.env.single_turn import SingleTurnEnv
from relax_gym.env.spaces import MessageSpace
from relax_gym.messages import Message, message
from relax_gym.rewards import RewardResult, extract_boxed, extract_tag

_INTEGER = re.compile(r"(?<!\w)-?\d+")
MAX_INT_DIGITS = 30  # longer "integers" are junk; int() of a huge string is slow and capped by Python
MAX_EXPRESSION_CHARS = 200


def last_integer(text: str) -> int | None:
    """The last integer written in `text` (a leading minus counts unless glued to a word, as in `x-3`)."""
    tail = deque(_INTEGER.finditer(text), maxlen=1)
    if not tail or len(tail[0].group().lstrip("-")) > MAX_INT_DIGITS:
        return None
    return int(tail[0].group())


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate_expression(source: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression and the integers it uses, via `ast` (never `eval`).

    Only integers, + - * /, unary minus and parentheses are allowed; anything
    else raises ValueError with a reason the env reports.
    """
    numbers: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"{ast.dump(node)[:40]}... is not allowed; use integers, + - * / and parentheses")

    try:
        return walk(ast.parse(source.strip(), mode="eval").body), numbers
    except ZeroDivisionError as err:
        raise ValueError("division by zero") from err
    except (SyntaxError, RecursionError, MemoryError) as err:
        raise ValueError(f"not an arithmetic expression ({type(err).__name__})") from err


def chain_value(terms: list[int], ops: list[str]) -> int:
    """The value of `terms[0] ops[0] terms[1] ...` over + - * with the usual precedence, as `evaluate_expression`
    gives it, without parsing: a run resets an env per episode, and the parse was half of each reset."""
    total, sign, product = 0, 1, terms[0]
    for op, term in zip(ops, terms[1:], strict=True):
        if op == "*":
            product *= term
        else:
            total, sign, product = total + sign * product, 1 if op == "+" else -1, term
    return total + sign * product


class ArithmeticEnv(SingleTurnEnv):
    """Integer arithmetic like `7 + 3 * 5`; reward 1 for the exact integer."""

    blocking = False  # microseconds of pure Python per step

    def __init__(
        self, digits: int = 1, n_terms: int = 2, ops: str = "+-", answer_format: Literal["plain", "boxed"] = "plain"
    ):
        super().__init__()
        if digits < 1 or n_terms < 2:
            raise ValueError(f"need digits >= 1 and n_terms >= 2, got digits={digits}, n_terms={n_terms}")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"ops must be a non-empty string over '+-*', got {ops!r}")
        if answer_format not in ("plain", "boxed"):
            raise ValueError(f"answer_format must be 'plain' or 'boxed', got {answer_format!r}")
        self.digits, self.n_terms, self.ops, self.answer_format = digits, n_terms, ops, answer_format

    def new_task(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        terms = [int(n) for n in rng.integers(low, 10**self.digits, size=self.n_terms)]
        # the draws of `rng.choice(list(self.ops))`, without building an array of strings each time
        ops = [self.ops[rng.integers(0, len(self.ops))] for _ in range(self.n_terms - 1)]
        expression = " ".join([str(terms[0]), *(f"{op} {term}" for op, term in zip(ops, terms[1:], strict=True))])
        value = chain_value(terms, ops)
        how = "Reply with just the integer." if self.answer_format == "plain" else "Put the final answer in \\boxed{}."
        return {"prompt": f"What is {expression}? {how}", "answer": int(value)}

    def grade(self, task: dict[str, Any], answer: str) -> RewardResult:
        if self.answer_format == "boxed":
            boxed = extract_boxed(answer)
            if boxed is None:
                return RewardResult(0.0, detail="no \\boxed{} answer found")
            text = boxed
        else:
            text = answer
        guess = last_integer(text)
        if guess is None:
            return RewardResult(0.0, detail="no integer found", extracted=text[:100] or None)
        score = float(guess == task["answer"])
        return RewardResult(score, detail=None if score else f"expected {task['answer']}", extracted=str(guess))

    def task_info(self, task: dict[str, Any]) -> dict[str, Any]:
        return {"answer_format": self.answer_format}

    def scripted_actions(self) -> list[str]:
        """The `ScriptedEnv` hook (`relax-gym check`, benchmarks/env_step.py): one plain answer."""
        return ["7"]


class CountdownEnv(SingleTurnEnv):
    """Countdown: reach the target with + - * / using each given number at most once."""

    blocking = False  # microseconds of pure Python per step

    def __init__(self, n_numbers: int = 3, max_number: int = 10, max_target: int = 100, format_score: float = 0.1):
        super().__init__()
        if n_numbers < 2 or max_number < 1:
            raise ValueError(f"need n_numbers >= 2 and max_number >= 1, got {n_numbers}, {max_number}")
        if max_target < 2 * max_number:  # keeps a solvable target reachable on every draw (see new_task)
            raise ValueError(f"max_target must be at least 2 * max_number = {2 * max_number}, got {max_target}")
        if not 0.0 <= format_score <= 1.0:
            raise ValueError(f"format_score must be in [0, 1], got {format_score}")
        self.n_numbers, self.max_number, self.max_target = n_numbers, max_number, max_target
        self.format_score = format_score

    def new_task(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        """Folds the numbers in a random order with random ops, so the target always has a solution."""
        numbers = [int(n) for n in rng.integers(1, self.max_number + 1, size=self.n_numbers)]
        order = [numbers[i] for i in rng.permutation(self.n_numbers)]
        value, solution = order[0], str(order[0])
        for n in order[1:]:
            # Never empty: '-' fits when value > n, else value + n <= 2 * max_number <= max_target.
            choices = [
                (op, result)
                for op, result in (("+", value + n), ("-", value - n), ("*", value * n))
                if 1 <= result <= self.max_target
            ]
            op, value = choices[int(rng.integers(len(choices)))]
            solution = f"({solution}) {op} {n}" if " " in solution else f"{solution} {op} {n}"
        prompt = (
            f"Using the numbers {numbers}, create an equation that equals {value}. You can use +, -, * and / "
            "and each number at most once. Return the final equation in <answer> </answer> tags, "
            "for example <answer>(1 + 2) * 3</answer>."
        )
        return {"prompt": prompt, "numbers": numbers, "target": value, "solution": solution}

    def grade(self, task: dict[str, Any], answer: str) -> RewardResult:
        """TinyZero's countdown reward: 0 without an <answer>, `format_score` for a wrong one, 1 if right."""
        equation = extract_tag(answer, "answer")
        if equation is None:
            return RewardResult(0.0, detail="no <answer>...</answer> found")
        partial = self.format_score
        if len(equation) > MAX_EXPRESSION_CHARS:  # a real answer is short; this bounds the parse
            return RewardResult(partial, detail=f"the equation is longer than {MAX_EXPRESSION_CHARS} characters")
        try:
            value, used = evaluate_expression(equation)
        except ValueError as err:
            return RewardResult(partial, detail=str(err), extracted=equation)
        extra = Counter(used) - Counter(task["numbers"])
        if extra:
            detail = f"uses numbers not given (or too often): {sorted(extra.elements())}"
            return RewardResult(partial, detail=detail, extracted=equation)
        if value != task["target"]:
            return RewardResult(partial, detail=f"equals {value}, not {task['target']}", extracted=equation)
        return RewardResult(1.0, extracted=equation)

    def scripted_actions(self) -> list[str]:
        """The `ScriptedEnv` hook (`relax-gym check`, benchmarks/env_step.py): one answer."""
        return ["<answer>(1+2)*3</answer>"]


class GuessNumberEnv(EpisodeState, Env[list[Message]]):
    """Guess a secret integer in [low, high] from higher/lower feedback."""

    blocking = False  # microseconds of pure Python per step

    metadata: dict[str, Any] = {**Env.metadata, "modalities": ("text",)}  # noqa: RUF012 (see Env.metadata)

    def __init__(self, low: int = 1, high: int = 16, max_turns: int = 6, shaped: bool = False):
        if high < low:
            raise ValueError(f"need low <= high, got low={low}, high={high}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.low, self.high, self.max_turns, self.shaped = low, high, max_turns, shaped
        self.observation_space = MessageSpace(modalities=self.metadata["modalities"])
        self.episode: dict[str, Any] = {}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.episode = {"secret": int(self.np_random.integers(self.low, self.high + 1)), "turn": 0, "done": False}
        prompt = (
            f"I am thinking of an integer from {self.low} to {self.high}. You have {self.max_turns} guesses. "
            "Reply with one integer; after each guess I will tell you whether the secret number is higher or lower."
        )
        return [message("user", prompt)], {"turn": 0}

    def step(self, action: str) -> StepResult:
        ep = self.running_episode()
        ep["turn"] += 1
        guess = last_integer(action)
        info: dict[str, Any] = {"turn": ep["turn"], "guess": guess}
        if guess == ep["secret"]:
            ep["done"] = True
            result = RewardResult(self._found_reward(ep["turn"]), extracted=str(guess))
            return [], result.score, True, False, {**info, "feedback": "correct", "reward": result.to_info()}
        feedback, text = self._feedback(guess, ep["secret"])
        observation = [message("user", text)]
        if ep["turn"] >= self.max_turns:
            ep["done"] = True
            result = RewardResult(0.0, detail=f"not found in {self.max_turns} guesses; it was {ep['secret']}")
            info |= {"feedback": feedback, "truncated_by": "max_turns", "reward": result.to_info()}
            return observation, 0.0, False, True, info
        return observation, 0.0, False, False, {**info, "feedback": feedback}

    def scripted_actions(self) -> list[str]:
        """The `ScriptedEnv` hook (`relax-gym check`, benchmarks/env_step.py): a bisecting run of guesses."""
        return ["8", "4", "12", "2", "6", "10"]

    def _found_reward(self, turn: int) -> float:
        """1.0, or with `shaped` 1.0 on the first guess falling linearly to 1/max_turns on the last."""
        return 1.0 - (turn - 1) / self.max_turns if self.shaped else 1.0

    def _feedback(self, guess: int | None, secret: int) -> tuple[str, str]:
        if guess is None:
            return (
                "invalid",
                f"I could not find an integer in your reply. Reply with one integer from {self.low} to {self.high}.",
            )
        return ("higher", f"Higher than {guess}.") if secret > guess else ("lower", f"Lower than {guess}.")
