"""When a decoding row ends, and why: one rule for both of the embedded engine's schedulers, so a request stops
at the same token whichever batches it."""

from __future__ import annotations

from collections.abc import Callable

from relax_gym.engines.base import FinishReason, SamplingParams


def finish_reason(ids: list[int], params: SamplingParams, *, stop_id: bool, aborted: bool,
                  decode: Callable[[list[int]], str]) -> FinishReason | None:
    """Why a row with output `ids` (its newest token just added) ends now, or None if it goes on. Stop strings
    are looked for in enough trailing tokens to hold any of them, even at one byte per token."""
    if aborted:
        return "abort"
    if stop_id:
        return "stop"
    if params.stop:
        window = 4 * max(map(len, params.stop)) + 4
        if any(s in decode(ids[-window:]) for s in params.stop):
            return "stop"
    if len(ids) >= params.max_new_tokens:
        return "length"
    return None
