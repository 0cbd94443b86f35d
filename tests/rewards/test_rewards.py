"""relax_gym.rewards against the real math-verify: extraction, scores, timeouts, threads."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relax_gym.rewards import (
    RewardResult,
    exact_match_reward,
    extract_boxed,
    extract_dapo_answer,
    extract_tag,
    f1_reward,
    format_reward,
    math_answer,
    math_reward,
    multiple_choice_reward,
    shutdown_math_workers,
    think_answer_format,
)


def boxed(answer: str) -> str:
    return f"Reasoning... so the final answer is \\boxed{{{answer}}}."


# (gold, completion, expected score), checked against math-verify 0.9.0.
MATH_ROWS = [
    # integers and signs
    ("34", boxed("34"), 1.0),
    ("34", boxed("35"), 0.0),
    ("-5", boxed("-5"), 1.0),
    ("-5", boxed("5"), 0.0),
    ("0", boxed("0"), 1.0),
    ("10", boxed("010"), 1.0),
    ("7", boxed("7.0"), 1.0),
    ("7", boxed("7.00001"), 0.0),
    ("2", boxed(r"\sqrt{4}"), 1.0),
    # fractions
    (r"\frac{1}{2}", boxed("0.5"), 1.0),
    (r"\frac{1}{2}", boxed("1/2"), 1.0),
    (r"\frac{1}{2}", boxed(r"\dfrac{1}{2}"), 1.0),
    (r"\frac12", boxed(r"\frac{1}{2}"), 1.0),
    ("0.5", boxed(r"\frac{1}{2}"), 1.0),
    (r"\frac{1}{2}", boxed(r"\frac{2}{4}"), 1.0),
    (r"\frac{1}{2}", boxed(r"\frac{1}{3}"), 0.0),
    (r"-\frac{1}{2}", boxed("-0.5"), 1.0),
    (r"\frac{-1}{2}", boxed(r"-\frac12"), 1.0),
    (r"\frac{3}{4}", boxed(r"\tfrac{3}{4}"), 1.0),
    # math-verify rounds floats to 6 decimals: 0.333 is wrong, 0.333333 is accepted
    (r"\frac{1}{3}", boxed("0.333"), 0.0),
    (r"\frac{1}{3}", boxed("0.333333"), 1.0),
    # roots, pi, e
    (r"\sqrt{2}", boxed(r"\frac{2}{\sqrt{2}}"), 1.0),
    (r"2\sqrt{3}", boxed(r"\sqrt{12}"), 1.0),
    (r"\sqrt{2}", boxed("1.414"), 0.0),
    (r"\frac{\sqrt{3}}{2}", boxed(r"\frac{1}{2}\sqrt{3}"), 1.0),
    (r"\frac{\sqrt{3}}{2}", boxed("0.866"), 0.0),
    (r"2\pi", boxed(r"\pi \cdot 2"), 1.0),
    (r"\pi", boxed(r"\pi"), 1.0),
    (r"\pi", boxed("3.14"), 0.0),
    (r"\pi", boxed("3.14159"), 0.0),
    ("e", boxed("2.718281828"), 1.0),
    # percentages: math-verify accepts 50% as both 50 and 0.5
    (r"50\%", boxed("50"), 1.0),
    (r"50\%", boxed("0.5"), 1.0),
    ("50", boxed(r"50\%"), 1.0),
    (r"50\%", boxed(r"50\%"), 1.0),
    (r"50\%", boxed("40"), 0.0),
    # intervals, sets, tuples
    ("[1,2)", boxed("[1,2)"), 1.0),
    ("[1,2)", boxed("[1,2]"), 0.0),
    (r"(-\infty, 3]", boxed(r"(-\infty,3]"), 1.0),
    (r"\{1,2\}", boxed(r"\{2,1\}"), 1.0),
    (r"\{1,2\}", boxed(r"\{1,3\}"), 0.0),
    ("1,2", boxed("2,1"), 1.0),  # a bare list parses as a set
    ("(1,2)", boxed("(1,2)"), 1.0),  # parsed as an open interval on both sides
    ("(1,2)", boxed("(2,1)"), 0.0),
    ("(3,-4)", boxed("(3,-4)"), 1.0),
    # matrices
    (r"\begin{pmatrix}1\\2\end{pmatrix}", boxed(r"\begin{pmatrix}1\\2\end{pmatrix}"), 1.0),
    (r"\begin{pmatrix}1\\2\end{pmatrix}", boxed(r"\begin{pmatrix}2\\1\end{pmatrix}"), 0.0),
    (r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", boxed(r"\begin{bmatrix}1&2\\3&4\end{bmatrix}"), 1.0),
    # degrees: ^\circ is dropped, not converted, so pi/6 is not 30 degrees
    (r"30^\circ", boxed("30"), 1.0),
    ("30", boxed(r"30^{\circ}"), 1.0),
    (r"30^\circ", boxed(r"\frac{\pi}{6}"), 0.0),
    # scientific notation (plain e-notation is rewritten: math-verify reads "e" as Euler's number)
    ("1500", boxed(r"1.5\times10^{3}"), 1.0),
    ("1500", boxed(r"1.5 \cdot 10^3"), 1.0),
    ("1500", boxed("1.5e3"), 1.0),
    ("1e-3", boxed("0.001"), 1.0),
    (r"10^{-3}", boxed("0.001"), 1.0),
    ("1500", boxed("1.5e4"), 0.0),
    # units and \text{}
    ("5", boxed(r"5\text{ cm}"), 1.0),
    (r"5\text{ cm}", boxed("5"), 1.0),
    ("12", boxed(r"12 \text{ apples}"), 1.0),
    # math-verify strips only the units it knows: "dollars" is read as a product of symbols
    ("12", boxed("12 dollars"), 0.0),
    # ...and a unit inside \text{} with the number becomes one symbol "5cm"
    (r"\text{5 cm}", boxed("5"), 0.0),
    (r"\text{Monday}", boxed(r"\text{Monday}"), 1.0),
    (r"\$5", boxed("5"), 1.0),
    ("5", boxed(r"\$5"), 1.0),
    # thousands separators
    ("1000", boxed("1,000"), 1.0),
    ("1000000", boxed("1,000,000"), 1.0),
    ("1000", boxed("1{,}000"), 1.0),
    # math-verify does not treat a thin space as a thousands separator
    ("1000", boxed(r"1\,000"), 0.0),
    # equations: an assignment is compared by its right-hand side
    ("3", boxed("x=3"), 1.0),
    ("3", boxed("x = 3"), 1.0),
    ("x=3", boxed("3"), 1.0),
    ("x=3", boxed("y=3"), 0.0),
    ("3", boxed("x=4"), 0.0),
    ("y=2x+1", boxed("y = 1 + 2x"), 1.0),
    ("2x+1", boxed("1+2x"), 1.0),
    ("x^2-1", boxed("(x-1)(x+1)"), 1.0),
    ("x^2-1", boxed("(x-1)^2"), 0.0),
    # close but wrong
    ("1", boxed("0.9999999"), 0.0),
    ("1", boxed("0.99"), 0.0),
    ("100", boxed("99.9"), 0.0),
    ("12", boxed("21"), 0.0),
    ("1", boxed("-1"), 0.0),
    # assorted notation
    (r"\log_2 8", boxed("3"), 1.0),
    (r"\binom{5}{2}", boxed("10"), 1.0),
    ("5!", boxed("120"), 1.0),
    (r"\infty", boxed(r"\infty"), 1.0),
    ("1+i", boxed("i+1"), 1.0),
    ("3", boxed("3."), 1.0),
    ("3", boxed(" 3 "), 1.0),
    ("3", boxed("$3$"), 1.0),
    # extraction: nested, several (last wins), absent, truncated, \fbox, empty
    ("3", r"\boxed{\boxed{3}}", 1.0),
    ("3", r"first \boxed{2}, then corrected: \boxed{3}", 1.0),
    ("2", r"first \boxed{2}, then corrected: \boxed{3}", 0.0),
    ("3", "The answer is 3.", 0.0),
    ("3", r"\boxed{3} then \boxed{4", 1.0),
    ("3", r"\fbox{3}", 1.0),
    ("3", r"\boxed{}", 0.0),
    ("3", "", 0.0),
    # <answer> tags and DAPO "Answer:" lines
    ("3", "<think>2+1</think><answer>3</answer>", 1.0),
    ("3", "<answer>4</answer>", 0.0),
    ("3", "<answer>The answer is $3$</answer>", 1.0),
    ("34", "Let me compute.\nAnswer: 34", 1.0),
    ("34", "Answer: 33\n...wait.\nAnswer: 34", 1.0),
    ("34", "answer: $34$", 1.0),
    ("34", "Answer: 34.", 1.0),
    ("34", "Answer: 35", 0.0),
    ("34", "Answer:\n34", 1.0),
    # gold already boxed or delimited
    (r"\boxed{34}", boxed("34"), 1.0),
    ("$34$", boxed("34"), 1.0),
]
MODES = {"inline": None, "workers": 30.0}


@pytest.fixture(scope="module", autouse=True)
def _stop_workers():
    yield
    shutdown_math_workers()


@pytest.mark.parametrize("timeout_s", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize(("gold", "completion", "expected"), MATH_ROWS)
def test_math_table(gold: str, completion: str, expected: float, timeout_s: float | None) -> None:
    result = math_reward(completion, gold, timeout_s=timeout_s)
    assert result.status == "ok", result
    assert result.score == expected, result


@pytest.mark.parametrize(
    ("completion", "answer_format", "score", "detail"),
    [
        ("Answer: 3", "boxed", 0.0, "no \\boxed{} answer found"),
        (r"\boxed{3}", "dapo", 0.0, "no 'Answer:' answer found"),
        (r"\boxed{4}" "\nAnswer: 3", "dapo", 1.0, None),
        (r"\boxed{4}" "\nAnswer: 3", "auto", 0.0, "answer is not equivalent to the gold answer"),
        ("3", "raw", 1.0, None),
        ("  3  ", "raw", 1.0, None),
        ("The result is $3$.", "raw", 1.0, None),
        ("no answer here", "auto", 0.0, "no \\boxed{} or <answer> or 'Answer:' answer found"),
        (r"\boxed{  }", "boxed", 0.0, "the extracted answer is empty"),
    ],
)
def test_math_answer_formats(completion: str, answer_format: str, score: float, detail: str | None) -> None:
    result = math_reward(completion, "3", answer_format=answer_format, timeout_s=None)  # type: ignore[arg-type]
    assert (result.status, result.score, result.detail) == ("ok", score, detail)


def test_math_records_extracted_answer() -> None:
    result = math_reward(r"so \boxed{\frac{1}{2}} done", "0.5", timeout_s=None)
    assert result == RewardResult(1.0, "ok", None, r"\frac{1}{2}")


@pytest.mark.parametrize("timeout_s", MODES.values(), ids=MODES.keys())
def test_math_unparsable_gold_is_an_error_not_a_wrong_answer(timeout_s: float | None) -> None:
    result = math_reward(r"\boxed{3}", "", timeout_s=timeout_s)
    assert (result.status, result.score, result.extracted) == ("error", 0.0, "3")
    assert "gold" in (result.detail or "")


@pytest.mark.parametrize(("answer_format", "timeout_s"), [("latex", 5.0), ("auto", 0.0), ("auto", -1.0)])
def test_math_bad_arguments_are_errors(answer_format: str, timeout_s: float) -> None:
    result = math_reward(r"\boxed{3}", "3", answer_format=answer_format, timeout_s=timeout_s)  # type: ignore[arg-type]
    assert (result.status, result.score) == ("error", 0.0)


# Expanding this polynomial takes sympy far longer than any test should wait.
PATHOLOGICAL = r"\boxed{(x+1)^{100000}}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout_s", [1e-3, 0.5])
def test_math_timeout_is_a_status_and_the_worker_is_replaced(timeout_s: float) -> None:
    result = math_reward(PATHOLOGICAL, "2", timeout_s=timeout_s)
    assert result == RewardResult(0.0, "timeout", f"timed out after {timeout_s:g}s", "(x+1)^{100000}")
    assert math_reward(boxed("2"), "2", timeout_s=30).score == 1.0


@pytest.mark.timeout(60)
def test_math_worker_killed_mid_request_is_an_error() -> None:
    results: list[RewardResult] = []
    caller = threading.Thread(target=lambda: results.append(math_reward(PATHOLOGICAL, "2", timeout_s=50)))
    caller.start()
    while not (math_answer._pool and math_answer._pool._busy):  # wait for the request to be in flight
        time.sleep(0.01)
    shutdown_math_workers()
    caller.join()
    assert (results[0].status, results[0].score) == ("error", 0.0)
    assert "worker" in (results[0].detail or "")
    assert math_reward(boxed("2"), "2").score == 1.0  # a fresh pool starts on demand


@pytest.mark.timeout(120)
@pytest.mark.parametrize("timeout_s", MODES.values(), ids=MODES.keys())
def test_math_threads_agree_with_sequential(timeout_s: float | None) -> None:
    rows = MATH_ROWS[::3]
    sequential = [math_reward(c, g, timeout_s=timeout_s) for g, c, _ in rows]
    with ThreadPoolExecutor(8) as pool:
        runs = [pool.submit(lambda: [math_reward(c, g, timeout_s=timeout_s) for g, c, _ in rows]) for _ in range(8)]
        assert all(run.result() == sequential for run in runs)


EXTRACT_BOXED_ROWS = [
    (r"\boxed{3}", "3"),
    (r"a \boxed{1} b \boxed{2}", "2"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\boxed{3}}", r"\boxed{3}"),
    (r"\fbox{7}", "7"),
    (r"\boxed {7}", "7"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),
    (r"\boxed{\}}", r"\}"),
    (r"\boxed{1} and a truncated \boxed{\frac{2}{", "1"),
    (r"\boxed{}", ""),
    ("no box", None),
    (r"\boxed{unclosed", None),
    (r"\boxed", None),
    ("", None),
]


@pytest.mark.parametrize(("text", "expected"), EXTRACT_BOXED_ROWS)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: 34", "34"),
        ("answer: 1\nmore work\nANSWER:  2 ", "2"),
        ("Final Answer: $\\frac{1}{2}$", "$\\frac{1}{2}$"),
        ("Answer:\n34", "34"),
        ("The answer is 34", None),
        ("Answer:", None),
        ("", None),
    ],
)
def test_extract_dapo_answer(text: str, expected: str | None) -> None:
    assert extract_dapo_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "tag", "expected"),
    [
        ("<answer>42</answer>", "answer", "42"),
        ("<answer>1</answer> then <answer> 2 </answer>", "answer", "2"),
        ("<think>hmm</think><answer>x</answer>", "think", "hmm"),
        ("<answer>unclosed", "answer", None),
        ("</answer>", "answer", None),
        ("", "answer", None),
    ],
)
def test_extract_tag(text: str, tag: str, expected: str | None) -> None:
    assert extract_tag(text, tag) == expected


CHOICES = ["Paris", "London", "Berlin", "New York"]
MC_ROWS = [
    ("<answer>B</answer>", "B", None, 1.0),
    ("<answer>(B)</answer>", "B", None, 1.0),
    ("<answer>B</answer>", "C", None, 0.0),
    ("<answer>b</answer>", "B", None, 0.0),  # a lowercase letter is a word, not a choice
    (r"so \boxed{C}", "C", None, 1.0),
    (r"\boxed{\text{C}}", "C", None, 1.0),
    ("(D)", "D", None, 1.0),
    ("B. London is the capital", "B", None, 1.0),
    ("B) London", "B", None, 1.0),
    ("A", "A", None, 1.0),
    ("Option C", "C", None, 1.0),
    ("After comparing, the answer is B.", "B", None, 1.0),
    ("Answer: (A)", "A", None, 1.0),
    ("(A) fails and (C) fails, so the answer is (B).", "B", None, 1.0),
    ("I considered (A) and (C). The answer is D", "C", None, 0.0),
    ("I pick (C) here.", "C", None, 1.0),
    ("A car is faster than a bike.", "A", None, 0.0),  # the article "A" is not an answer
    ("<answer>London</answer>", "B", CHOICES, 1.0),
    ("<answer>london.</answer>", "B", CHOICES, 1.0),
    ("I am sure it is Berlin.", "C", CHOICES, 1.0),
    ("The city is New York.", "D", CHOICES, 1.0),  # "New York", not a lone "York"
    ("<answer>Madrid</answer>", "A", CHOICES, 0.0),
    ("no letter at all", "A", None, 0.0),
    ("", "A", None, 0.0),
]
AMBIGUOUS_ROWS = [
    ("<answer>A or C</answer>", "A"),
    (r"\boxed{A, C}", "C"),
    ("The answer is B and D", "B"),
    ("(A) or maybe (B)", "A"),
    ("It is Paris or London.", "A"),
]


@pytest.mark.parametrize(("completion", "gold", "choices", "expected"), MC_ROWS)
def test_multiple_choice(completion: str, gold: str, choices: list[str] | None, expected: float) -> None:
    result = multiple_choice_reward(completion, gold, choices=choices)
    assert (result.status, result.score) == ("ok", expected), result


@pytest.mark.parametrize(("completion", "gold"), AMBIGUOUS_ROWS)
def test_multiple_choice_two_letters_are_ambiguous(completion: str, gold: str) -> None:
    result = multiple_choice_reward(completion, gold, choices=CHOICES)
    assert (result.status, result.score) == ("ok", 0.0)
    assert (result.detail or "").startswith("ambiguous answer")


@pytest.mark.parametrize(("gold", "choices"), [("AB", None), ("", None), ("7", None), ("E", CHOICES)])
def test_multiple_choice_bad_gold_is_an_error(gold: str, choices: list[str] | None) -> None:
    assert multiple_choice_reward("A", gold, choices=choices).status == "error"


@pytest.mark.parametrize(
    ("completion", "gold", "normalize", "expected"),
    [
        ("Paris", "Paris", True, 1.0),
        ("  the Paris!  ", "paris", True, 1.0),
        ("<answer>The Eiffel Tower.</answer>", "eiffel tower", True, 1.0),
        ("Paris, France", "Paris", True, 0.0),
        ("an apple", ["a pear", "apple"], True, 1.0),
        ("Paris", "paris", False, 0.0),
        (" Paris ", "Paris", False, 1.0),
        ("", "Paris", True, 0.0),
    ],
)
def test_exact_match(completion: str, gold: str | list[str], normalize: bool, expected: float) -> None:
    result = exact_match_reward(completion, gold, normalize=normalize)
    assert (result.status, result.score) == ("ok", expected)


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("the cat sat", "cat sat", 1.0),
        ("cat sat on mat", "cat sat", 2 / 3),  # precision 1/2, recall 1
        ("cat", "cat sat", 2 / 3),  # precision 1, recall 1/2
        ("dog", "cat", 0.0),
        ("<answer>Barack Obama</answer> and more text", "Obama", 2 / 3),
        ("cat cat", "cat", 2 / 3),  # repeated tokens count once per gold occurrence
        ("a the an", "the", 1.0),  # only articles: both normalise to empty
        ("", "cat", 0.0),
        ("cat", ["dog", "cat"], 1.0),
    ],
)
def test_f1(completion: str, gold: str | list[str], expected: float) -> None:
    result = f1_reward(completion, gold)
    assert result.status == "ok"
    assert result.score == pytest.approx(expected)


@pytest.mark.parametrize("reward", [exact_match_reward, f1_reward])
def test_text_rewards_without_gold_are_errors(reward) -> None:
    assert reward("x", []).status == "error"


# A missing truth (None, a parquet NaN, a blank string) must never be matched, whatever the answer: an
# empty answer equals an empty gold, and str(None) / str(nan) equal the replies "None" / "nan".
MISSING_GOLDS = [None, float("nan"), "", "  \n"]
ANSWERS_TO_MISSING = ["", "<answer></answer>", "None", "nan", "<answer>nan</answer>", "\\boxed{nan}", "A", "3"]
GRADERS = {
    "math-inline": lambda answer, gold: math_reward(answer, gold, timeout_s=None),
    "math-workers": lambda answer, gold: math_reward(answer, gold, timeout_s=30.0),
    "math-raw": lambda answer, gold: math_reward(answer, gold, answer_format="raw", timeout_s=None),
    "exact": exact_match_reward,
    "exact-raw": lambda answer, gold: exact_match_reward(answer, gold, normalize=False),
    "f1": f1_reward,
    "choice": multiple_choice_reward,
    "choice-options": lambda answer, gold: multiple_choice_reward(answer, gold, choices=["nan", "None", ""]),
}


@pytest.mark.parametrize("grader", GRADERS.values(), ids=GRADERS.keys())
@pytest.mark.parametrize("gold", MISSING_GOLDS, ids=repr)
def test_missing_gold_is_an_error_whatever_the_answer(grader, gold) -> None:
    for answer in ANSWERS_TO_MISSING:
        result = grader(answer, gold)
        assert (result.status, result.score) == ("error", 0.0), (answer, result)
        assert "gold answer is missing" in (result.detail or ""), result


@pytest.mark.parametrize("reward", [exact_match_reward, f1_reward])
def test_one_missing_gold_among_several_is_an_error(reward) -> None:
    result = reward("", ["Paris", ""])
    assert (result.status, result.score) == ("error", 0.0)
    assert "gold answer 1 is missing" in (result.detail or "")


@pytest.mark.parametrize("timeout_s", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("gold", ["nan", "NaN", " NAN "])
def test_math_gold_nan_text_is_a_missing_value_not_an_answer(gold: str, timeout_s: float | None) -> None:
    result = math_reward(r"\boxed{nan}", gold, timeout_s=timeout_s)
    assert (result.status, result.score, result.extracted) == ("error", 0.0, "nan")


TAGS = ("think", "answer")


@pytest.mark.parametrize(
    ("completion", "pattern", "tags", "expected", "detail"),
    [
        ("<think>a</think><answer>b</answer>", None, TAGS, 1.0, None),
        ("<answer>b</answer>", None, TAGS, 0.0, "missing <think>; missing </think>"),
        (
            "<think>a</think><think>c</think><answer>b</answer>",
            None,
            TAGS,
            0.0,
            "<think> appears 2 times; </think> appears 2 times",
        ),
        ("</think>a<think><answer>b</answer>", None, TAGS, 0.0, "</think> comes before <think>"),
        ("<answer>b</answer><think>a</think>", None, TAGS, 0.0, "<answer> comes before </think>"),
        ("<think>a<answer>b</answer></think>", None, TAGS, 0.0, "<answer> comes before </think>"),
        ("abc123", r"[a-z]+\d+", (), 1.0, None),
        ("abc123!", r"[a-z]+\d+", (), 0.0, "does not match the pattern '[a-z]+\\\\d+'"),
        ("line1\nline2", r"line1.line2", (), 1.0, None),  # re.DOTALL
        (
            "<answer>1</answer> extra",
            r"<answer>.*</answer>",
            ("answer",),
            0.0,
            "does not match the pattern '<answer>.*</answer>'",
        ),
    ],
)
def test_format_reward(
    completion: str, pattern: str | None, tags: tuple[str, ...], expected: float, detail: str | None
) -> None:
    result = format_reward(completion, pattern=pattern, required_tags=tags)
    assert (result.status, result.score, result.detail) == ("ok", expected, detail)


@pytest.mark.parametrize(
    ("completion", "think_in_prompt", "expected"),
    [
        ("<think>\nstep\n</think>\n<answer>\n3\n</answer>\n", False, 1.0),
        ("<think>step</think><answer>3</answer>", False, 1.0),
        ("step</think><answer>3</answer>", True, 1.0),
        ("step</think><answer>3</answer>", False, 0.0),
        ("<think>step</think>3", False, 0.0),
        ("preamble <think>step</think><answer>3</answer>", False, 0.0),
        ("<think>step</think><answer>3</answer> trailing", False, 0.0),
        ("", False, 0.0),
    ],
)
def test_think_answer_format(completion: str, think_in_prompt: bool, expected: float) -> None:
    result = think_answer_format(completion, think_in_prompt=think_in_prompt)
    assert (result.status, result.score) == ("ok", expected)


@pytest.mark.parametrize(("pattern", "tags"), [(None, ()), ("(", ())])
def test_format_reward_bad_arguments_are_errors(pattern: str | None, tags: tuple[str, ...]) -> None:
    assert format_reward("x", pattern=pattern, required_tags=tags).status == "error"


def test_reward_result() -> None:
    result = RewardResult(0.0, "timeout", "timed out after 5s", "3")
    assert json.loads(json.dumps(result.to_info())) == {
        "score": 0.0,
        "status": "timeout",
        "detail": "timed out after 5s",
        "extracted": "3",
    }
    with pytest.raises(AttributeError):
        result.score = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"must score 0\.0"):
        RewardResult(1.0, "error")


# Arbitrary text, enriched with the fragments the extractors and parsers react to.
FRAGMENTS = st.sampled_from(
    [
        "\\boxed{",
        "\\fbox{",
        "{",
        "}",
        "\\",
        "$",
        "<answer>",
        "</answer>",
        "<think>",
        "</think>",
        "Answer:",
        "(B)",
        "B.",
        "\\frac",
        "^",
        "=",
        ",",
        "\\{",
        "\\}",
        "\n",
        "the answer is ",
        "1",
        "x",
        "e5",
        "%",
    ]
)
TEXT = st.lists(st.one_of(st.text(max_size=20), FRAGMENTS), max_size=30).map("".join)
CHOICE_LISTS = st.none() | st.lists(st.text(max_size=10), max_size=6)
GOLD = st.one_of(st.sampled_from(["3", r"\frac{1}{2}", "x=2", "(1,2)", r"\{1\}", ""]), st.text(max_size=10))


def _assert_well_formed(result: RewardResult) -> None:
    assert isinstance(result, RewardResult)
    assert result.status in ("ok", "timeout", "error")
    assert 0.0 <= result.score <= 1.0
    json.dumps(result.to_info())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completion=TEXT, gold=GOLD, answer_format=st.sampled_from(["auto", "boxed", "dapo", "raw"]))
def test_math_never_raises_inline(completion: str, gold: str, answer_format: str) -> None:
    _assert_well_formed(math_reward(completion, gold, answer_format=answer_format, timeout_s=None))  # type: ignore[arg-type]


@pytest.mark.timeout(300)
@settings(max_examples=25, deadline=None)
@given(completion=TEXT, gold=GOLD)
def test_math_never_raises_with_workers(completion: str, gold: str) -> None:
    _assert_well_formed(math_reward(completion, gold, answer_format="raw", timeout_s=10))


@settings(max_examples=200, deadline=None)
@given(completion=TEXT, gold=st.text(max_size=3), choices=CHOICE_LISTS)
def test_text_rewards_never_raise(completion: str, gold: str, choices: list[str] | None) -> None:
    for result in (
        multiple_choice_reward(completion, gold, choices=choices),
        multiple_choice_reward(completion, "A", choices=choices or None),
        exact_match_reward(completion, gold),
        exact_match_reward(completion, gold, normalize=False),
        f1_reward(completion, gold),
        format_reward(completion, required_tags=("think", "answer")),
        format_reward(completion, pattern=r".*\d.*"),
        think_answer_format(completion),
        think_answer_format(completion, think_in_prompt=True),
    ):
        _assert_well_formed(result)
    for extracted in (extract_boxed(completion), extract_dapo_answer(completion), extract_tag(completion)):
        assert extracted is None or isinstance(extracted, str)
