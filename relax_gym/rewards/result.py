"""The outcome of one reward computation."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, ParamSpec

RewardStatus = Literal["ok", "timeout", "error"]
_P = ParamSpec("_P")


@dataclass(frozen=True)
class RewardResult:
    """A score plus why: a timeout or crash scores 0.0 but says so in ``status``.

    ``detail`` explains a non-full score (or the failure); ``extracted`` is the answer
    taken from the completion, if any, so wrong extractions can be told from wrong answers.
    """

    score: float
    status: RewardStatus = "ok"
    detail: str | None = None
    extracted: str | None = None

    def __post_init__(self) -> None:
        if self.status != "ok" and self.score != 0.0:
            raise ValueError(f"a {self.status!r} result must score 0.0, got {self.score}")

    def to_info(self) -> dict[str, Any]:
        """A JSON-serialisable dict, for a step's ``info``."""
        return dict(vars(self))  # the fields are plain scalars: `asdict`'s deep copy would only cost time


def never_raises(fn: Callable[_P, RewardResult]) -> Callable[_P, RewardResult]:
    """Turn any exception into an ``error`` result: a reward must not crash a rollout."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> RewardResult:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            return RewardResult(0.0, "error", f"{type(exc).__name__}: {exc}")

    return wrapper


def is_missing(value: Any) -> bool:
    """None, a float NaN (how parquet and pandas hold a missing value) or a blank string."""
    if value is None:
        return True
    if isinstance(value, numbers.Real):  # numpy floats too
        return math.isnan(value)
    return isinstance(value, str) and not value.strip()


def missing_gold(gold: Any, extracted: str | None = None) -> RewardResult | None:
    """An error result when ``gold`` (or one of several golds) is missing, else None.

    Graders check this before matching: an empty answer equals an empty gold, and
    ``str(None)`` or ``str(nan)`` would equal a reply of "None" or "nan".
    """
    golds = list(gold) if isinstance(gold, list | tuple) else [gold]
    for i, value in enumerate(golds):
        if is_missing(value):
            which = f"gold answer {i}" if len(golds) > 1 else "gold answer"
            return RewardResult(0.0, "error", f"the {which} is missing ({value!r}): nothing to compare with", extracted)
    return None
