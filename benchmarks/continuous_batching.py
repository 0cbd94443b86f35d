"""Continuous vs static batching in the embedded engine, on a multi-turn workload with mixed lengths.

Each of `--conversations` conversations runs `--turns` turns one after the other, as a rollout
manager's episodes do: a turn's request is the whole history (its first prompt of 20-200 tokens,
then each earlier output and a 10-60-token "env" message), and its output budget is drawn from
4 / 16 / 64 / 128 tokens. All conversations start at once. Every request is seeded, so both engines
generate exactly the same tokens (the script checks), and tokens/s compares like with like.

Static batching (`rollout.engine_batching=static`): one `model.generate` per batch, which runs until
its longest row stops; a turn that arrives meanwhile waits for the whole batch. Continuous batching
(the default): a request joins the running batch at the next step and leaves it when it stops.
Both run in this process, alternately, pinned to one core with one torch thread, `--repeats` times.

    .venv/bin/python benchmarks/continuous_batching.py                 # 64 conversations x 4 turns
    .venv/bin/python benchmarks/continuous_batching.py --quick         # 8 x 2: does it work
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "examples" / "checkpoints" / "tiny-arithmetic"
BUDGETS = (4, 16, 64, 128)


def plan(conversations: int, turns: int, vocab: int, seed: int) -> list[list[tuple[list[int], int]]]:
    """Per conversation, per turn: the new tokens the turn adds (first prompt or env message) and its budget."""
    rng = random.Random(seed)

    def tokens(low: int, high: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(rng.randint(low, high))]

    return [[(tokens(20, 200) if t == 0 else tokens(10, 60), rng.choice(BUDGETS)) for t in range(turns)]
            for _ in range(conversations)]


async def run(batching: str, workload: list[list[tuple[list[int], int]]], max_batch_size: int) -> tuple[float, int,
                                                                                                        list]:
    """Wall seconds, generated tokens, and every output's ids, for one engine over the whole workload."""
    from relax_gym.engines import EmbeddedEngine, GenerateRequest, SamplingParams
    from relax_gym.models import load_model

    engine = EmbeddedEngine(load_model(str(CHECKPOINT)), max_batch_size=max_batch_size, batching=batching)  # type: ignore[arg-type]

    async def conversation(c: int, turns: list[tuple[list[int], int]]) -> list[list[int]]:
        history: list[int] = []
        outputs = []
        for t, (new, budget) in enumerate(turns):
            history += new
            request = GenerateRequest(list(history), SamplingParams(temperature=1.0, max_new_tokens=budget,
                                                                    seed=1000 * c + t))
            out = await engine.generate(request)
            outputs.append(out.output_ids)
            history += out.output_ids
        return outputs

    try:
        start = time.perf_counter()
        results = await asyncio.gather(*(conversation(c, turns) for c, turns in enumerate(workload)))
        wall = time.perf_counter() - start
    finally:
        await engine.close()
    return wall, sum(len(ids) for conv in results for ids in conv), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="8 conversations x 2 turns, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns, args.repeats = 8, 2, 1
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import torch

    torch.set_num_threads(1)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(CHECKPOINT).vocab_size
    workload = plan(args.conversations, args.turns, vocab, seed=0)
    print(f"{args.conversations} conversations x {args.turns} turns, budgets {BUDGETS}, max batch "
          f"{args.max_batch_size}, 1 core, 1 torch thread")
    seen: dict[str, list[float]] = {"static": [], "continuous": []}
    outputs: dict[str, list] = {}
    tokens = 0
    for _ in range(args.repeats):
        for batching in ("static", "continuous"):
            wall, tokens, outputs[batching] = asyncio.run(run(batching, workload, args.max_batch_size))
            seen[batching].append(tokens / wall)
            print(f"  {batching:10s} {wall:6.2f} s  {tokens} tokens  {tokens / wall:8.0f} tokens/s", flush=True)
    if outputs["static"] != outputs["continuous"]:
        raise SystemExit("the two engines generated different tokens: the comparison is void")
    ratio = median(seen["continuous"]) / median(seen["static"])
    print(f"\n| batching | tokens/s (median of {args.repeats}) |\n|---|---:|")
    for batching, rates in seen.items():
        print(f"| {batching} | {median(rates):.0f} |")
    print(f"\ncontinuous / static: {ratio:.2f}x ({tokens} tokens per run, the same tokens on both)")


if __name__ == "__main__":
    main()
