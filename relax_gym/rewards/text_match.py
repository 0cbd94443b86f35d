"""SQuAD-style exact match and token F1 for short free-text answers."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

from relax_gym.rewards.extract import extract_tag
from relax_gym.rewards.result import RewardResult, missing_gold, never_raises

_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lowercase, drop punctuation and articles, collapse spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def _answer(completion: str) -> str:
    """The ``<answer>`` tag's content when there is one, else the whole completion."""
    tagged = extract_tag(completion)
    return completion if tagged is None else tagged


def _golds(gold: str | Sequence[str]) -> list[str]:
    golds = list(gold) if isinstance(gold, Iterable) and not isinstance(gold, str) else [gold]
    if not golds:
        raise ValueError("no gold answer given")
    return golds


def _token_f1(pred: str, gold: str) -> float:
    pred_tokens, gold_tokens = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:  # SQuAD v2: empty only matches empty
        return float(pred_tokens == gold_tokens)
    overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


@never_raises
def exact_match_reward(completion: str, gold: str | Sequence[str], *, normalize: bool = True) -> RewardResult:
    """1.0 when the answer equals ``gold`` (or any of several golds).

    ``normalize=False`` compares the answer and gold with only outer whitespace stripped. A
    missing gold (None, NaN, blank) is an "error", never matched.
    """
    golds = _golds(gold)
    answer = _answer(completion)
    if missing := missing_gold(golds, answer):
        return missing
    key = normalize_answer if normalize else str.strip
    if any(key(answer) == key(g) for g in golds):
        return RewardResult(1.0, extracted=answer)
    return RewardResult(0.0, detail="answer differs from the gold answer", extracted=answer)


@never_raises
def f1_reward(completion: str, gold: str | Sequence[str]) -> RewardResult:
    """Token-level F1 of the normalised answer against ``gold`` (the best of several golds).

    A missing gold (None, NaN, blank) is an "error" rather than SQuAD v2's empty-matches-empty.
    """
    golds = _golds(gold)
    answer = _answer(completion)
    if missing := missing_gold(golds, answer):
        return missing
    score = max(_token_f1(answer, g) for g in golds)
    detail = None if score == 1.0 else "partial token overlap" if score else "no token overlap"
    return RewardResult(score, detail=detail, extracted=answer)
