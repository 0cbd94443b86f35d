"""Math answer reward: extract the final answer, then check equivalence with math-verify."""

from __future__ import annotations

import atexit
import os
import threading
from typing import Literal

from relax_gym.rewards._pool import WorkerPool
from relax_gym.rewards.extract import extract_boxed, extract_dapo_answer, extract_tag
from relax_gym.rewards.result import RewardResult, missing_gold, never_raises

AnswerFormat = Literal["auto", "boxed", "dapo", "raw"]

_FORMATS = {
    "auto": ((extract_boxed, "\\boxed{}"), (extract_tag, "<answer>"), (extract_dapo_answer, "'Answer:'")),
    "boxed": ((extract_boxed, "\\boxed{}"),),
    "dapo": ((extract_dapo_answer, "'Answer:'"),),
}
# Workers are mostly idle (a check takes milliseconds); a few absorb the odd slow one.
_POOL_SIZE = min(4, os.cpu_count() or 1)
_pool: WorkerPool | None = None
_pool_lock = threading.Lock()
# math-verify and sympy do not promise thread safety, and under the GIL the inline path
# gains nothing from running concurrently.
_inline_lock = threading.Lock()


def _shared_pool() -> WorkerPool:
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():
            _pool = WorkerPool(_POOL_SIZE)
        return _pool


def shutdown_math_workers() -> None:
    """Kill the math-verify workers (also run at exit); the next call starts new ones."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None and pool.pid == os.getpid():
        pool.close()


atexit.register(shutdown_math_workers)


def _extract(completion: str, answer_format: AnswerFormat) -> str | None:
    if answer_format == "raw":
        return completion
    if answer_format not in _FORMATS:
        raise ValueError(f"answer_format must be auto, boxed, dapo or raw; got {answer_format!r}")
    for extractor, _ in _FORMATS[answer_format]:
        if (answer := extractor(completion)) is not None:
            return answer
    return None


@never_raises
def math_reward(
    completion: str,
    gold: str,
    *,
    answer_format: AnswerFormat = "auto",
    timeout_s: float | None = 5.0,
) -> RewardResult:
    """1.0 when the completion's final answer is mathematically equivalent to ``gold``.

    ``auto`` takes the last ``\\boxed{}``, else the last ``<answer>`` tag, else the last
    ``Answer:`` line. With ``timeout_s`` the check runs in a worker process that is killed
    when it overruns (status "timeout"); ``None`` runs it inline in this thread, unbounded.
    An unparsable or missing ``gold`` is an "error": a data problem, not a wrong answer.
    The text "nan" counts as missing: it is a NaN gone through ``str()``, and math-verify
    would read it as the product n*a*n, equal to any "nan" reply.
    """
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive or None, got {timeout_s}")
    answer = _extract(completion, answer_format)
    if missing := missing_gold(gold, answer):
        return missing
    if not isinstance(gold, str):
        raise TypeError(f"gold must be a string, got {type(gold).__name__}")
    if gold.strip().casefold() == "nan":
        return RewardResult(0.0, "error", f"the gold answer is {gold!r}, a missing value written as text", answer)
    if answer is None:
        looked_for = " or ".join(label for _, label in _FORMATS[answer_format])
        return RewardResult(0.0, detail=f"no {looked_for} answer found")
    if not answer.strip():
        return RewardResult(0.0, detail="the extracted answer is empty", extracted=answer)
    try:
        if timeout_s is None:
            from relax_gym.rewards import _verifier  # sympy is only needed here when inline

            with _inline_lock:
                correct, detail = _verifier.compare(gold, answer)
        else:
            reply = _shared_pool().request({"gold": gold, "pred": answer}, timeout_s)
            if "error" in reply:
                return RewardResult(0.0, "error", reply["error"], answer)
            correct, detail = reply["correct"], reply["detail"]
    except TimeoutError:
        return RewardResult(0.0, "timeout", f"timed out after {timeout_s:g}s", answer)
    except Exception as exc:
        return RewardResult(0.0, "error", f"{type(exc).__name__}: {exc}", answer)
    return RewardResult(float(correct), detail=detail, extracted=answer)
