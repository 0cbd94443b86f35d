"""Pull the final answer out of a completion; pure, linear-time string functions."""

from __future__ import annotations

import re

_BOX_OPENER = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE_TOKEN = re.compile(r"\\[\\{}]|[{}]")  # an escaped brace or backslash is not a group
# The answer pattern of DAPO-Math-17k's reward (verl's math_dapo.is_correct_minerva).
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def extract_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}``, nested braces kept.

    "Last" is by closing position, so ``\\boxed{\\boxed{3}}`` gives ``\\boxed{3}`` and an
    unclosed (truncated) box is skipped.
    """
    box_braces = {match.end() - 1 for match in _BOX_OPENER.finditer(text)}
    if not box_braces:
        return None
    stack: list[int] = []
    last: tuple[int, int] | None = None
    for token in _BRACE_TOKEN.finditer(text):
        if token[0] == "{":
            stack.append(token.start())
        elif token[0] == "}" and stack:
            opened = stack.pop()
            if opened in box_braces:
                last = (opened + 1, token.start())
    return None if last is None else text[last[0] : last[1]]


def extract_dapo_answer(text: str) -> str | None:
    """The rest of the line after the last ``Answer:`` (case-insensitive), as DAPO does."""
    matches = _DAPO_ANSWER.findall(text)
    return matches[-1].strip() if matches else None


def extract_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the last ``<tag>...</tag>``, stripped; None when there is no closed pair."""
    close = text.rfind(f"</{tag}>")
    if close < 0:
        return None
    opening = f"<{tag}>"
    start = text.rfind(opening, 0, close)
    return None if start < 0 else text[start + len(opening) : close].strip()
