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

import argparse
import asyncio
import re
from pathlib import Path

from relax_gym.engines import ScriptedEngine
from relax_gym.envs.gsm8k_steps import load_steps
from relax_gym.models import LoadedModel, load_model
from relax_gym.rollout import RolloutLimits, RolloutManager
from relax_gym.tools import tool_format_for
from relax_gym.trajectory import write_jsonl

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


async def demonstrations(loaded: LoadedModel, n: int, out: Path) -> int:
    manager = RolloutManager(ScriptedEngine(loaded, replies(loaded)), loaded,
                             limits=RolloutLimits(max_turns=3, max_total_tokens=2048))
    try:
        played = await manager.run(ENV, n, 1)
    finally:
        await manager.close()
    solved = [t for t in played if t.status == "completed" and t.reward == 1.0]
    return write_jsonl(solved, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--chat-template", default=None, help="as `relax-gym sft --chat-template` will get it")
    parser.add_argument("-n", type=int, default=32)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    loaded = load_model(args.model, chat_template=args.chat_template)
    written = asyncio.run(demonstrations(loaded, args.n, args.out))
    print(f"wrote {written} solved demonstrations of {args.n} to {args.out}")


if __name__ == "__main__":
    main()
