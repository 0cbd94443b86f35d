"""Demonstrations of `relax/GSM8KSteps-v0` (GSM8K's calculator steps with the sandboxed python tool), played by
`ScriptedEngine` through the real rollout manager, for `relax-gym sft`: a model that never calls a tool learns
the format from them (docs/envs.md, "Real data in steps", has what SmolLM2 reached).

    python examples/gsm8k_steps_demos.py --model MODEL --chat-template chatml-tools -n 32 --out demos.jsonl
    relax-gym sft demos.jsonl --model MODEL --chat-template chatml-tools --epochs 1 --lr 5e-5 --out warm

Each demonstration runs the step's annotated expression (`print(48/2)`) in its first turn, then answers what the
tool printed. The expression is the annotator's, looked up from the line the prompt shows: the demonstrator is
an oracle. Only training steps are played (seeds 0..n-1 pick among the 224 of `split="train"`).
"""

from __future__ import annotations

import re
from pathlib import Path

from relax_gym.envs.gsm8k_steps import load_steps
from relax_gym.models import LoadedModel
from relax_gym.rollout import RolloutLimits
from relax_gym.rollout.demonstrations import demonstrations_cli, play_demonstrations
from relax_gym.tools import tool_format_for

ENV = "relax/GSM8KSteps-v0"
STDOUT = re.compile(r"stdout:\s*(\S+)")


def replies(loaded: LoadedModel):
    """Turn 0: a `python` call printing the step's expression; turn 1: the printed value, answered."""
    calls = tool_format_for(loaded.tokenizer)
    expressions = {step.line: step.expression for step in load_steps("train")}

    def reply(turn) -> str:
        if turn.turn == 0:
            line = next(line for line in expressions if line in turn.text)
            return calls.write_calls([("python", {"code": f"print({expressions[line]})"})])
        value = STDOUT.findall(turn.text)[-1]
        return f"The tool printed {value}. \\boxed{{{value}}}"

    return reply


LIMITS = RolloutLimits(max_turns=3, max_total_tokens=2048)


async def demonstrations(loaded: LoadedModel, n: int, out: Path) -> int:
    return await play_demonstrations(loaded, replies, ENV, n, out, LIMITS)


if __name__ == "__main__":
    demonstrations_cli(__doc__, replies, ENV, LIMITS, default_n=32)
