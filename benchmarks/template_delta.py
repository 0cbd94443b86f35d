"""The cost of appending one env turn: our template delta vs re-rendering the whole conversation.

A re-render per turn (render all messages, tokenize the text) is the baseline:
it is what a bookkeeping that re-templates the history does, and its cost
grows with the conversation. The delta renders a fixed stand-in plus the new
messages (twice: the delta and the probe that locates the new messages), so
its cost should not. Measured on the fixture templates of tests/support/families
(Qwen3, which rewrites history; Llama 3, which does not), per turn, at
several conversation lengths, in the same process.

    python benchmarks/template_delta.py [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.families import FAMILIES

from relax_gym.messages import message
from relax_gym.models import render_ids
from relax_gym.models.template_traits import turn_end_id
from relax_gym.rollout import ConversationTokens

LENGTHS = (2, 8, 32)


def _conversation(loaded, turns: int) -> ConversationTokens:
    tok = loaded.tokenizer
    stop = turn_end_id(loaded)
    conv = ConversationTokens.start(loaded, [message("system", "Guess a number."), message("user", "Go.")])
    for i in range(turns):
        ids = tok(f"I guess {i}.", add_special_tokens=False)["input_ids"] + [stop]
        conv.append_generation(ids, [0.0] * len(ids), 0, loaded.stop_token_ids())
        if i < turns - 1:
            conv.append_observation([message("user", f"Higher than {i}.")])
    return conv


def measure(family: str, turns: int, repeats: int) -> tuple[float, float]:
    """Median seconds per turn: (the delta append, a full re-render + tokenize) at a conversation of `turns`."""
    loaded = FAMILIES[family].loaded()
    conv = _conversation(loaded, turns)
    new = [message("user", "Lower than 3.")]
    delta, full = [], []
    for _ in range(repeats):
        trial = ConversationTokens(conv.loaded, conv.tools, list(conv.messages), list(conv.token_ids),
                                   list(conv.loss_mask), list(conv.logprobs), list(conv.versions),
                                   list(conv.segments), traits=conv.traits)
        start = time.perf_counter()
        trial.append_observation(new)
        delta.append(time.perf_counter() - start)
        start = time.perf_counter()
        render_ids(loaded, conv.messages + new, add_generation_prompt=True)
        full.append(time.perf_counter() - start)
    return statistics.median(delta), statistics.median(full)


def main(repeats: int) -> str:
    lines = [f"Per env turn, median of {repeats}; baseline: re-render + tokenize the whole conversation.", "",
             "| template | turns so far | delta ms | re-render ms | delta / re-render |", "|---|---:|---:|---:|---:|"]
    for family in ("qwen3", "llama3"):
        for turns in LENGTHS:
            delta, full = measure(family, turns, repeats)
            lines.append(f"| {family} | {turns} | {1e3 * delta:.3f} | {1e3 * full:.3f} | {delta / full:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
