"""Format rewards: does the completion have the required shape, whatever its content."""

from __future__ import annotations

import re
from collections.abc import Sequence

from relax_gym.rewards.result import RewardResult, never_raises

_THINK_ANSWER = r"\s*<think>.*</think>\s*<answer>.*</answer>\s*"


def _tag_problems(text: str, tags: Sequence[str]) -> list[str]:
    """What keeps each tag from appearing exactly once, well-formed and in the given order."""
    problems: list[str] = []
    previous: tuple[str, int] | None = None  # (closing tag, where it ends)
    for tag in tags:
        opening, closing = f"<{tag}>", f"</{tag}>"
        counts = {opening: text.count(opening), closing: text.count(closing)}
        wrong = [f"{t} appears {n} times" if n else f"missing {t}" for t, n in counts.items() if n != 1]
        if wrong:
            problems.extend(wrong)
            continue
        start, end = text.index(opening), text.index(closing)
        if end < start:
            problems.append(f"{closing} comes before {opening}")
            continue
        if previous is not None and start < previous[1]:
            problems.append(f"{opening} comes before {previous[0]}")
        previous = (closing, end + len(closing))
    return problems


@never_raises
def format_reward(completion: str, *, pattern: str | None = None, required_tags: Sequence[str] = ()) -> RewardResult:
    """1.0 when ``pattern`` matches the whole completion (re.DOTALL) and every tag in
    ``required_tags`` appears exactly once as ``<tag>...</tag>``, in that order."""
    if pattern is None and not required_tags:
        raise ValueError("format_reward needs a pattern, required_tags or both")
    if problems := _tag_problems(completion, required_tags):
        return RewardResult(0.0, detail="; ".join(problems))
    if pattern is not None and re.fullmatch(pattern, completion, re.DOTALL) is None:
        return RewardResult(0.0, detail=f"does not match the pattern {pattern!r}")
    return RewardResult(1.0)


def think_answer_format(completion: str, *, think_in_prompt: bool = False) -> RewardResult:
    """``<think>...</think>`` then ``<answer>...</answer>``, nothing but whitespace around.

    ``think_in_prompt``: the chat template already opened ``<think>`` in the prompt (as
    DeepSeek-R1's does), so the completion starts inside the thinking block.
    """
    if think_in_prompt and isinstance(completion, str):
        completion = "<think>" + completion
    return format_reward(completion, pattern=_THINK_ANSWER, required_tags=("think", "answer"))
