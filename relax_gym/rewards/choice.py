"""Multiple-choice reward: find the letter the completion commits to."""

from __future__ import annotations

import re
from collections.abc import Sequence

from relax_gym.rewards.extract import extract_boxed, extract_tag
from relax_gym.rewards.result import RewardResult, missing_gold, never_raises
from relax_gym.rewards.text_match import normalize_answer

_LETTER = r"\(?[A-Z](?![A-Za-z0-9'])\)?"
# "A or C", "A/C", "A, C": stating two letters is ambiguous, never a lucky guess.
_LETTERS = rf"{_LETTER}(?:\s*(?:,|/|&|\bor\b|\band\b)\s*{_LETTER})*"
_ONLY_LETTERS = re.compile(rf"\s*(?:(?i:option|choice)\s*)?({_LETTERS})\s*\.?\s*")
_LEADING = re.compile(r"\s*(?:\(([A-Z])\)|([A-Z])[.):](?!\w))")
_STATED = re.compile(rf"(?i:answer)\s*(?:(?i:is)|:)\s*:?\s*(?:(?i:option|choice)\s*)?({_LETTERS})")
_PARENTHESIZED = re.compile(r"\(([A-Z])\)")
_CAPITAL = re.compile(r"[A-Z]")
_UNWRAP = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")


def _distinct(letters: list[str]) -> list[str]:
    return list(dict.fromkeys(letters))


def _stated(text: str) -> list[str]:
    """Letters of the last "answer is X" / "answer: X" statement."""
    statements = _STATED.findall(text)
    return _distinct(_CAPITAL.findall(statements[-1])) if statements else []


def _leading(text: str) -> list[str]:
    """A reply that is only letters ("B", "(B)", "A or C") or starts "B." / "B)" / "(B)"."""
    if only := _ONLY_LETTERS.fullmatch(text):
        return _distinct(_CAPITAL.findall(only[1]))
    lead = _LEADING.match(text)
    return [lead[1] or lead[2]] if lead else []


def _by_text(text: str, choices: Sequence[str]) -> list[str]:
    """Letters whose option text the reply equals, else contains (longest options win)."""
    said = f" {normalize_answer(text)} "
    options = {chr(ord("A") + i): normalize_answer(c) for i, c in enumerate(choices)}
    options = {letter: option for letter, option in options.items() if option}
    if exact := [letter for letter, option in options.items() if said == f" {option} "]:
        return exact
    found = {letter: option for letter, option in options.items() if f" {option} " in said}
    return [
        letter
        for letter, option in found.items()
        if not any(option != other and f" {option} " in f" {other} " for other in found.values())
    ]


def _letters(completion: str, choices: Sequence[str] | None) -> list[str]:
    """The distinct letters the completion commits to, from the most explicit source."""
    for span in (extract_tag(completion), extract_boxed(completion)):
        if span is not None:
            span = _UNWRAP.sub(r"\1", span).strip()
            return _leading(span) or _stated(span) or (_by_text(span, choices) if choices else [])
    return (
        _stated(completion)
        or _distinct(_leading(completion) + _PARENTHESIZED.findall(completion))
        or (_by_text(completion, choices) if choices else [])
    )


@never_raises
def multiple_choice_reward(completion: str, gold: str, *, choices: Sequence[str] | None = None) -> RewardResult:
    """1.0 when the completion commits to the letter ``gold`` (A-Z), and to no other.

    Looks in the last ``<answer>`` tag, else the last ``\\boxed{}``, else the whole text
    ("the answer is B", a leading "B." / "(B)", a lone "(B)"); with ``choices`` the option's
    text counts too. Two different letters are ambiguous and score 0. A missing ``gold``
    (None, NaN, blank) is an "error".
    """
    if missing := missing_gold(gold):
        return missing
    gold_letter = gold.strip().strip("()").upper()
    if not re.fullmatch(r"[A-Z]", gold_letter):
        raise ValueError(f"gold must be a letter A-Z, got {gold!r}")
    if choices is not None and ord(gold_letter) - ord("A") >= len(choices):
        raise ValueError(f"gold {gold_letter} is beyond the {len(choices)} choices")
    letters = _letters(completion, choices)
    if not letters:
        return RewardResult(0.0, detail="no choice letter found")
    if len(letters) > 1:
        return RewardResult(0.0, detail=f"ambiguous answer: {', '.join(letters)}", extracted=", ".join(letters))
    if letters[0] == gold_letter:
        return RewardResult(1.0, extracted=gold_letter)
    return RewardResult(0.0, detail=f"chose {letters[0]}, not {gold_letter}", extracted=letters[0])
