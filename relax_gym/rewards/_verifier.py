"""Math-verify equivalence check, importable in-process and runnable as a worker script.

The worker runs as ``python -P _verifier.py PARENT_PID`` so that it imports only math-verify, not
relax_gym (whose top level is heavy); hence no package-relative imports here. Protocol:
one JSON object per line on stdin ``{"gold", "pred"}``; one per line on stdout, first
``{"ready": true}``, then ``{"correct", "detail"}`` or ``{"error"}`` per request.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# Boxed content first: we hand math-verify an already-extracted answer.
_CONFIGS = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
# Math already delimited ($...$, \(...\), \[...\]) is left for math-verify to find; an
# escaped \$ is a currency sign, not a delimiter.
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed\b")
# math-verify reads the "e" of 1.5e3 as Euler's number.
_E_NOTATION = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+))[eE]([-+]?\d+)")

# Our callers enforce the timeout (math-verify's own uses signal.alarm, main thread only),
# so silence its "timeout is disabled" warning.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def as_latex(answer: str) -> str:
    """Wrap a bare answer so math-verify parses all of it as one LaTeX expression."""
    answer = answer.strip().removesuffix(".").strip()
    if _DELIMITED.search(answer):
        return answer
    if number := _E_NOTATION.fullmatch(answer):
        answer = rf"{number[1]}\times 10^{{{number[2]}}}"
    return rf"\boxed{{{answer}}}"


def _parse(answer: str) -> list:
    return parse(as_latex(answer), extraction_config=_CONFIGS, parsing_timeout=None, raise_on_error=True)


def compare(gold: str, pred: str) -> tuple[bool, str | None]:
    """(whether ``pred`` is equivalent to ``gold``, why not); no timeout of its own.

    Raises ValueError when the gold answer cannot be parsed: that is a data problem, not a
    wrong answer.
    """
    gold_parsed = _parse(gold)
    if not gold_parsed:
        raise ValueError(f"math-verify could not parse the gold answer {gold!r}")
    pred_parsed = _parse(pred)
    if not pred_parsed:
        return False, "math-verify could not parse the answer"
    if verify(gold_parsed, pred_parsed, timeout_seconds=None, raise_on_error=True):
        return True, None
    return False, "answer is not equivalent to the gold answer"


def _exit_with(parent: int) -> None:
    """An orphan stuck in a runaway sympy computation would otherwise spin forever."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _serve(parent: int) -> None:
    # Ctrl-C belongs to the parent, which kills us; stdout is kept for the protocol and
    # anything the libraries print goes to stderr.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="ascii")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def reply(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    compare("1", "1")  # pay math-verify's lazy imports before declaring readiness
    reply({"ready": True})
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            correct, detail = compare(request["gold"], request["pred"])
            reply({"correct": correct, "detail": detail})
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
