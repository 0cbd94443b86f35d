"""Demonstrations of the README's tool env (`example/Shopping-v0`), played by `ScriptedEngine` through the real
rollout manager, for `relax-gym sft`: a model that never calls a tool learns the format from them, then RL
improves it.

    python examples/shopping_demos.py --model MODEL --chat-template chatml-tools -n 32 --out demos.jsonl
    relax-gym sft demos.jsonl --model MODEL --chat-template chatml-tools --epochs 1 --lr 5e-5 --out warm

(docs/training.md's ladder on SmolLM2-135M-Instruct: held-out pass@1 0 -> 0.31 from these, -> 0.52 after RL).
Each demonstration looks every item's price up in one turn of tool calls, then writes the sum out and answers
it (answering the bare total taught SmolLM2 the format but left its sums wrong: 0.28 greedy against 0.62
with the sum written out). The tokens are the model's own tokenizer's, rendered by the template it will be
trained and run with, on training seeds (0..n-1; held-out evals draw theirs from `EVAL_SEED_OFFSET`).
"""

from __future__ import annotations

import re
from pathlib import Path

from relax_gym.models import LoadedModel
from relax_gym.rollout import RolloutLimits
from relax_gym.rollout.demonstrations import demonstrations_cli, play_demonstrations
from relax_gym.tools import tool_format_for

#: the README's tool env, registered by the file beside this one
ENV = f"{Path(__file__).resolve().parent / 'custom_env.py'}:example/Shopping-v0"
ITEMS = re.compile(r"What do (.+?) cost together\?")
PRICE = re.compile(r"<tool_response>\s*(\d+)\s*</tool_response>")


def replies(loaded: LoadedModel):
    """Turn 0: a `price` call per item of the question; turn 1: the prices the tools answered, added up in the
    open before the answer (a small model sums better written out than in its head)."""
    calls = tool_format_for(loaded.tokenizer)

    def reply(turn) -> str:
        if turn.turn == 0:
            items = ITEMS.findall(turn.text)[-1].split(", ")
            return calls.write_calls([("price", {"item": item}) for item in items])
        prices = PRICE.findall(turn.text)
        total = sum(map(int, prices))
        return f"{' + '.join(prices)} = {total}. <answer>{total}</answer>"

    return reply


LIMITS = RolloutLimits(max_turns=4, max_total_tokens=2048)


async def demonstrations(loaded: LoadedModel, n: int, out: Path) -> int:
    return await play_demonstrations(loaded, replies, ENV, n, out, LIMITS)


if __name__ == "__main__":
    demonstrations_cli(__doc__, replies, ENV, LIMITS, default_n=64)
