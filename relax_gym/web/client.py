"""What every client of relax_gym's servers (and of SGLang and OpenAI-style ones) shares: the bearer header, the
error reader, the retry backoff."""

from __future__ import annotations

from typing import Any

import httpx


def bearer(key: str | None) -> dict[str, str]:
    """The header that carries `key`; none without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def error_body(response: httpx.Response) -> dict[str, Any]:
    """The `error` object of an answer in the one error shape, else {}."""
    try:
        body = response.json()
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def error_message(response: httpx.Response) -> str:
    """A failed answer's message on one line: the one shape's {"error": {"message"}}, SGLang's {"message"},
    {"error": "..."} and {"error_message"} (its LoRA routes), FastAPI's {"detail"}, else the text."""
    try:
        body = response.json()
    except ValueError:
        found: Any = response.text[:500] or response.reason_phrase
    else:
        if isinstance(body, dict):
            error = body.get("error")
            found = (error.get("message") if isinstance(error, dict) else error) or body.get("message") \
                or body.get("error_message") or body.get("detail") or body
        else:
            found = body
    return " ".join(str(found).split())[:500]


def backoff_delay(attempt: int, first_s: float = 0.5, cap_s: float = 5.0) -> float:
    """Seconds to wait before retry number `attempt` (1, 2, ...): doubling from `first_s`, at most `cap_s`,
    so a long outage is polled every `cap_s` rather than ever more rarely."""
    if attempt < 1:
        raise ValueError(f"attempt counts from 1, got {attempt}")
    return min(cap_s, first_s * 2.0 ** min(attempt - 1, 64))
