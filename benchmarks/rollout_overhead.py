"""The rollout manager's overhead: (wall - ideal) / ideal with a fixed-latency engine.

The engine here is a stand-in on purpose: it answers every request after a
fixed delay with a fixed reply, so the only thing that varies is the manager
(template deltas, tokenization, env steps in threads, bookkeeping). Episodes
are multi-turn (GuessNumber, `TURNS` turns each), all started at once; the
ideal wall time is TURNS × latency, since an episode's turns are sequential
and everything else could overlap.

    python benchmarks/rollout_overhead.py [LATENCY_S]
"""

from __future__ import annotations

import asyncio
import sys
import time

from relax_gym.cpu.process import settle_heap
from relax_gym.engines.base import GenerateOutput, GenerateRequest
from relax_gym.models import load_model
from relax_gym.rollout import RolloutLimits, RolloutManager

TURNS = 4
LEVELS = (1, 64, 256, 1024)


class FixedLatencyEngine:
    """Replies `reply_ids` after `latency_s`, whatever it is asked (measures the manager, not a model)."""

    def __init__(self, reply_ids: list[int], latency_s: float):
        self.reply_ids, self.latency_s = reply_ids, latency_s
        self.weight_version = 0
        self.requests = 0

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.requests += 1
        await asyncio.sleep(self.latency_s)
        return GenerateOutput(list(self.reply_ids), [-0.1] * len(self.reply_ids), "stop", self.weight_version)

    async def update_weights(self, weights, version):
        self.weight_version = version

    async def pause(self):
        pass

    async def resume(self):
        pass

    async def health(self):
        return True

    async def close(self):
        pass


async def one_level(loaded, episodes: int, latency_s: float, check_rerender: bool) -> dict:
    tok = loaded.tokenizer
    reply = tok("I guess 8.", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    engine = FixedLatencyEngine(reply, latency_s)
    manager = RolloutManager(engine, loaded, limits=RolloutLimits(max_turns=TURNS, check_rerender=check_rerender),
                             max_concurrency=episodes)
    # the secret is never 8 when high=6 is below it... keep every episode going for exactly TURNS turns
    kwargs = {"low": 1, "high": 7, "max_turns": TURNS + 1}
    await manager.run("relax/GuessNumber-v0", 1, 1, env_kwargs=kwargs)  # warm-up: env pool, template caches
    start = time.perf_counter()
    trajs = await manager.run("relax/GuessNumber-v0", episodes, 1, seed=1, env_kwargs=kwargs)
    wall = time.perf_counter() - start
    await manager.close()
    turns = {t.metrics["turns"] for t in trajs}
    assert turns == {TURNS}, f"episodes ran {turns} turns, expected {TURNS}"
    ideal = TURNS * latency_s
    return {"episodes": episodes, "wall_s": wall, "ideal_s": ideal, "overhead": (wall - ideal) / ideal}


def measure(latency_s: float = 1.0, check_rerender: bool = True) -> list[dict]:
    loaded = load_model("tiny")
    settle_heap()  # as `relax-gym rollout` and `relax-gym train` do after loading
    return [asyncio.run(one_level(loaded, n, latency_s, check_rerender)) for n in LEVELS]


def markdown(rows: list[dict], latency_s: float, check_rerender: bool) -> str:
    lines = [f"Fixed-latency engine: {latency_s} s per turn, {TURNS} turns per episode (GuessNumber), "
             f"re-render check {'on' if check_rerender else 'off'}.", "",
             "| concurrent episodes | wall s | ideal s | overhead (wall − ideal) / ideal |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['episodes']} | {r['wall_s']:.3f} | {r['ideal_s']:.3f} | {100 * r['overhead']:.2f} % |"
              for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    latency = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    for check in (True, False):
        print(markdown(measure(latency, check), latency, check))
        print()
