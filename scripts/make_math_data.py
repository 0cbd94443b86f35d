"""Writes the small math set shipped with `relax/Math-v0` (envs/data/math/{train,test}.jsonl).

The problems are generated, not copied, so the answers are exact by
construction and the files carry no licence of their own. Records use the
dapo-math-17k layout (`prompt` as chat messages, `reward_model.ground_truth`)
so the shipped set and a user's download go through the same loader.
The output is a pure function of the seed: rerunning rewrites identical files.

    python scripts/make_math_data.py [--seed 0] [--train 400] [--test 100] [--out envs/data/math]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

Problem = tuple[str, str]  # (problem text, exact answer in LaTeX)


def latex_number(value: Fraction | int) -> str:
    """An exact answer as a grader would write it: an integer or a reduced `\\frac`."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def arithmetic(rng: random.Random) -> Problem:
    a, b, c = rng.randint(10, 99), rng.randint(2, 12), rng.randint(1, 99)
    form = rng.randrange(3)
    if form == 0:
        return f"Compute $({a} + {c}) \\times {b}$.", str((a + c) * b)
    if form == 1:
        return f"Compute ${a} \\times {b} - {c}$.", str(a * b - c)
    return f"Compute ${a * b} \\div {b} + {c}$.", str(a + c)


def fractions(rng: random.Random) -> Problem:
    (a, b), (c, d) = [(rng.randint(1, den - 1), den) for den in (rng.randint(2, 9), rng.randint(2, 9))]
    x, y = Fraction(a, b), Fraction(c, d)
    op, value = rng.choice([("+", x + y), ("-", x - y), ("\\times", x * y)])
    return (
        f"Compute $\\frac{{{a}}}{{{b}}} {op} \\frac{{{c}}}{{{d}}}$. Express your answer as a fraction in lowest terms.",
        latex_number(value),
    )


def linear_equation(rng: random.Random) -> Problem:
    x = rng.randint(-12, 12)
    a = rng.choice([n for n in range(-9, 10) if n not in (0, 1)])
    b = rng.randint(-30, 30)
    c = a * x + b
    lhs = f"{a}x" + (f" + {b}" if b > 0 else f" - {-b}" if b < 0 else "")
    return f"Solve for $x$: ${lhs} = {c}$.", str(x)


def percentage(rng: random.Random) -> Problem:
    if rng.random() < 0.5:
        percent = rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 60, 75])
        step = 100 // math.gcd(percent, 100)  # the base must make the result whole
        base = step * rng.randint(1, 400 // step + 1)
        return f"What is ${percent}\\%$ of ${base}$?", str(percent * base // 100)
    whole = rng.choice([20, 25, 40, 50, 80, 200, 250, 400, 500])
    percent = rng.choice([p for p in range(1, 100) if p * whole % 100 == 0])
    part = percent * whole // 100
    return f"${part}$ is what percent of ${whole}$? Give the number without the percent sign.", str(percent)


def sqrt_simplify(rng: random.Random) -> Problem:
    outer = rng.randint(2, 12)
    inner = rng.choice([2, 3, 5, 6, 7, 10, 11, 13, 14, 15, 17, 19, 21, 22, 23])  # square-free
    return f"Simplify $\\sqrt{{{outer * outer * inner}}}$.", f"{outer}\\sqrt{{{inner}}}"


def word_problem(rng: random.Random) -> Problem:
    name = rng.choice(["Ava", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana"])
    form = rng.randrange(4)
    if form == 0:
        start, bags, per, given = rng.randint(3, 30), rng.randint(2, 6), rng.randint(3, 12), rng.randint(1, 10)
        return (
            f"{name} has {start} apples, buys {bags} bags with {per} apples each, then gives away {given} apples. "
            f"How many apples does {name} have now?",
            str(start + bags * per - given),
        )
    if form == 1:
        price, count = rng.randint(2, 15), rng.randint(2, 8)
        paid = price * count + rng.randint(0, 20)
        return (
            f"A notebook costs {price} dollars. {name} buys {count} notebooks and pays with {paid} dollars. "
            f"How many dollars of change does {name} get?",
            str(paid - price * count),
        )
    if form == 2:
        speed, hours = rng.randint(20, 90), rng.randint(2, 7)
        problem = f"A train travels at {speed} km per hour for {hours} hours. How many kilometres does it travel?"
        return problem, str(speed * hours)
    friends, each = rng.randint(2, 9), rng.randint(2, 12)
    left = rng.randint(0, friends - 1)
    total = friends * each + left
    return (
        f"{name} shares {total} stickers equally among {friends} friends and keeps the {left} left over. "
        "How many stickers does each friend get?",
        str(each),
    )


KINDS: dict[str, Callable[[random.Random], Problem]] = {
    "arithmetic": arithmetic,
    "fractions": fractions,
    "linear_equation": linear_equation,
    "percentage": percentage,
    "sqrt_simplify": sqrt_simplify,
    "word_problem": word_problem,
}


def record(problem: str, answer: str, kind: str, split: str, index: int) -> dict:
    return {
        "data_source": "relax_gym/synthetic_math",
        "prompt": [{"role": "user", "content": f"{problem}\n\n{INSTRUCTION}"}],
        "ability": "MATH",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "kind": kind},
    }


def generate(seed: int, n_train: int, n_test: int) -> dict[str, list[dict]]:
    """Distinct problems, kinds in turn, so both splits cover every kind and share no problem."""
    rng = random.Random(seed)
    names = list(KINDS)
    seen: set[str] = set()
    problems: list[tuple[str, str, str]] = []
    total = n_train + n_test
    for _ in range(100 * total):
        kind = names[len(problems) % len(names)]
        problem, answer = KINDS[kind](rng)
        if problem not in seen:
            seen.add(problem)
            problems.append((problem, answer, kind))
        if len(problems) == total:
            break
    if len(problems) < total:
        raise ValueError(f"only {len(problems)} distinct problems in {100 * total} draws; ask for fewer")
    rng.shuffle(problems)
    splits = {"train": problems[:n_train], "test": problems[n_train:]}
    return {split: [record(p, a, k, split, i) for i, (p, a, k) in enumerate(items)] for split, items in splits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "envs" / "data" / "math")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split, records in generate(args.seed, args.train, args.test).items():
        path = args.out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        print(f"wrote {len(records)} records to {path} ({path.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
