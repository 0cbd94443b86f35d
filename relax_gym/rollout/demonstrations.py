"""Scripted demonstrations for `relax-gym sft`: episodes an oracle plays (`ScriptedEngine`) through the real
rollout manager, so their tokens are the model's own tokenizer's under the template it will train with; only
the solved ones are kept. The examples' `*_demos.py` scripts give the oracle of one env each."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from pathlib import Path

from relax_gym.engines import ScriptedEngine
from relax_gym.engines.scripted import Reply
from relax_gym.env.registration import resolve_env_id
from relax_gym.models import LoadedModel, load_model
from relax_gym.rollout.config import RolloutLimits
from relax_gym.rollout.manager import RolloutManager
from relax_gym.trajectory import write_jsonl

#: an oracle: the model (for its tool format) to the reply it plays each turn with
Oracle = Callable[[LoadedModel], Reply]


async def play_demonstrations(loaded: LoadedModel, oracle: Oracle, env_id: str, n: int, out: Path,
                              limits: RolloutLimits) -> int:
    """Plays `n` episodes of `env_id` (an id, or `file.py:ID`; training seeds 0..n-1) and writes those completed
    at full reward to `out`; returns how many."""
    manager = RolloutManager(ScriptedEngine(loaded, oracle(loaded)), loaded, limits=limits)
    try:
        played = await manager.run(resolve_env_id(env_id), n, 1)
    finally:
        await manager.close()
    return write_jsonl([t for t in played if t.status == "completed" and t.reward == 1.0], out)


def demonstrations_cli(description: str, oracle: Oracle, env_id: str, limits: RolloutLimits, default_n: int) -> None:
    """A `*_demos.py` script's command line: --model, --chat-template (as `relax-gym sft` will get it), -n, --out."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--chat-template", default=None, help="as `relax-gym sft --chat-template` will get it")
    parser.add_argument("-n", type=int, default=default_n)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    loaded = load_model(args.model, chat_template=args.chat_template)
    written = asyncio.run(play_demonstrations(loaded, oracle, env_id, args.n, args.out, limits))
    print(f"wrote {written} solved demonstrations of {args.n} to {args.out}")
