"""The rollout manager's overhead at 1024 concurrent episodes, split over M rollout-worker processes.

The same method as `rollout_overhead.py`: a fixed-latency stand-in engine (it answers every turn after
LATENCY_S with a fixed reply, so only the manager's own work varies), GuessNumber episodes of `TURNS` turns,
all started at once; ideal = TURNS × LATENCY_S (an episode's turns are sequential, everything else could
overlap) and overhead = (wall − ideal) / ideal.

- baseline: the 1024 episodes on one in-process event loop (the same worker class, called in this process),
  measured twice in the same invocation: before Ray starts, and again after it is shut down (the mean of the two
  is the baseline). For reference, one loop with one worker's share (1024 / M episodes, M = 2, 4): what a split
  could reach at best, with a core per worker and no transport.
- M workers (M = 1, 2, 4): M Ray actors, each its own process holding its own `RolloutManager` over its own
  `FixedLatencyEngine` (the engine stays a stand-in inside each process, so this measures the manager and the
  process split, not engines or the engine transport). The 1024 episodes are split evenly (1024 / M each); the
  M calls are sent back to back and `wall` runs from the first send until the last worker's trajectories are back
  in the driver (they come back by value, as `WorkerPool.run_group`'s groups do). Each worker is warmed up (one
  episode, through the same call path) first. Reported beside it: the slowest worker's own wall (its
  `manager.run`), the dispatch skew (first send to the last worker starting), the return time (last worker
  done to all results in the driver) and the CPU time each process spent during its run (`time.process_time`,
  all its threads: Ray's own included).
- start-up, not counted in `wall`: `ray.init` once, and per M the time from creating the M actors until all have
  loaded the model and answered their warm-up.

The actors ask for 1 logical CPU each out of 8 announced, so Ray schedules all M at once whatever the machine
has; on a 2-core machine more than 2 processes cannot add CPU for CPU-bound work (and other jobs share it).

    python benchmarks/rollout_workers.py [LATENCY_S] [EPISODES]
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from statistics import fmean
from typing import Any, cast

import ray
from ray import cloudpickle

# benchmarks/ is no package: the sibling script's stand-in engine, imported from its folder
sys.path.insert(0, str(Path(__file__).resolve().parent))
import rollout_overhead
from rollout_overhead import TURNS, FixedLatencyEngine

from relax_gym.cpu.process import settle_heap
from relax_gym.engines.base import Engine
from relax_gym.models import load_model
from relax_gym.rollout import RolloutLimits, RolloutManager

WORKERS = (1, 2, 4)
ENV = "relax/GuessNumber-v0"
#: the secret is never 8 with high=7: every episode goes on for exactly TURNS turns (as in rollout_overhead.py)
ENV_KWARGS = {"low": 1, "high": 7, "max_turns": TURNS + 1}

cloudpickle.register_pickle_by_value(rollout_overhead)  # the actors' processes cannot import benchmarks/


class OverheadWorker:
    """One rollout process: the tiny model's tokenizer and template, a stand-in engine and a rollout manager."""

    def __init__(self, latency_s: float, episodes: int, check_rerender: bool = True):
        self.loaded = load_model("tiny")
        tok = self.loaded.tokenizer
        reply = tok("I guess 8.", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        # the stand-in has the Engine calls the manager makes (not `connect`, which only a run's start needs)
        self.engine = cast(Engine, FixedLatencyEngine(reply, latency_s))
        self.manager = RolloutManager(self.engine, self.loaded,
                                      limits=RolloutLimits(max_turns=TURNS, check_rerender=check_rerender),
                                      max_concurrency=episodes)
        settle_heap()  # as the real RolloutWorker does after loading

    async def play(self, episodes: int, seed: int) -> dict[str, Any]:
        """`episodes` concurrent episodes; their trajectories come back by value, with this process's clock and
        the CPU time it spent meanwhile (all its threads)."""
        cpu, start = time.process_time(), time.time()
        trajs = await self.manager.run(ENV, episodes, 1, seed=seed, env_kwargs=ENV_KWARGS)
        end = time.time()
        return {"pid": os.getpid(), "start": start, "end": end, "cpu_s": time.process_time() - cpu,
                "trajectories": trajs}

    async def warm_and_play(self, episodes: int) -> dict[str, Any]:
        """The in-process case: a warm-up episode, then the run, on one event loop."""
        await self.play(1, 0)
        return await self.play(episodes, 1)


def multi_process(m: int, episodes: int, latency_s: float) -> dict[str, Any]:
    per = episodes // m
    assert per * m == episodes, f"{episodes} episodes do not split evenly over {m} workers"
    t0 = time.perf_counter()
    actors: list[Any] = [ray.remote(OverheadWorker).options(num_cpus=1, max_concurrency=1000).remote(latency_s, per)
              for _ in range(m)]
    ray.get([a.play.remote(1, 0) for a in actors])  # warm-up: env pool, template caches, the call path
    startup = time.perf_counter() - t0
    sent = time.time()
    start = time.perf_counter()
    results = ray.get([a.play.remote(per, 1 + i * per) for i, a in enumerate(actors)])
    wall = time.perf_counter() - start
    received = time.time()
    for a in actors:
        ray.kill(a)
    trajs = [t for r in results for t in r["trajectories"]]
    turns = {t.metrics["turns"] for t in trajs}
    assert len(trajs) == episodes and turns == {TURNS}, f"{len(trajs)} episodes ran {turns} turns"
    assert len({r["pid"] for r in results}) == m
    ideal = TURNS * latency_s
    return {"workers": m, "episodes": episodes, "wall_s": wall, "ideal_s": ideal, "overhead": (wall - ideal) / ideal,
            "worker_wall_s": max(r["end"] - r["start"] for r in results),
            "dispatch_s": max(r["start"] for r in results) - sent,
            "return_s": received - max(r["end"] for r in results), "startup_s": startup,
            "cpu_s": [r["cpu_s"] for r in results]}


def in_process(episodes: int, latency_s: float) -> dict[str, Any]:
    """The same worker in this process, on one event loop (what `rollout_overhead.py` measures)."""
    r = asyncio.run(OverheadWorker(latency_s, episodes).warm_and_play(episodes))
    turns = {t.metrics["turns"] for t in r["trajectories"]}
    assert len(r["trajectories"]) == episodes and turns == {TURNS}, f"episodes ran {turns} turns"
    wall, ideal = r["end"] - r["start"], TURNS * latency_s
    return {"episodes": episodes, "wall_s": wall, "ideal_s": ideal, "overhead": (wall - ideal) / ideal,
            "cpu_s": r["cpu_s"]}


def measure(latency_s: float, episodes: int) -> dict[str, Any]:
    before = in_process(episodes, latency_s)
    shares = [in_process(episodes // m, latency_s) for m in WORKERS if m > 1]  # one worker's share, one loop
    t0 = time.perf_counter()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    ray_s = time.perf_counter() - t0
    try:
        rows = [multi_process(m, episodes, latency_s) for m in WORKERS]
    finally:
        ray.shutdown()
    after = in_process(episodes, latency_s)
    return {"baseline": [before, after], "shares": shares, "rows": rows, "ray_init_s": ray_s, "latency_s": latency_s,
            "episodes": episodes}


def markdown(res: dict[str, Any]) -> str:
    before, after = res["baseline"]
    base = fmean([before["overhead"], after["overhead"]])
    n = res["episodes"]
    lines = [f"Fixed-latency engine: {res['latency_s']} s per turn, {TURNS} turns per episode (GuessNumber), "
             f"{n} concurrent episodes, re-render check on. `ray.init`: {res['ray_init_s']:.1f} s (not in any wall).",
             "", "| rollout processes | wall s | ideal s | overhead (wall − ideal) / ideal | ratio to one loop | "
             "slowest worker's own wall s (overhead) | dispatch s | return s | CPU s per process | actor start-up s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def one_loop(label: str, r: dict[str, Any]) -> str:
        return (f"| {label} | {r['wall_s']:.3f} | {r['ideal_s']:.3f} | {100 * r['overhead']:.2f} % | "
                f"{r['overhead'] / base:.2f} | | | | {r['cpu_s']:.2f} | |")

    lines.append(one_loop(f"one in-process loop × {n}, before Ray", before))
    lines.append(one_loop(f"one in-process loop × {n}, after Ray", after))
    for r in res["shares"]:
        lines.append(one_loop(f"(reference) one in-process loop × {r['episodes']}: a worker's share at M = "
                              f"{n // r['episodes']}, no split", r))
    for r in res["rows"]:
        m = r["workers"]
        own = r["worker_wall_s"]
        lines.append(f"| M = {m} worker actor{'s' if m > 1 else ''} × {n // m} | {r['wall_s']:.3f} | "
                     f"{r['ideal_s']:.3f} | {100 * r['overhead']:.2f} % | {r['overhead'] / base:.2f} | "
                     f"{own:.3f} ({100 * (own - r['ideal_s']) / r['ideal_s']:.2f} %) | {r['dispatch_s']:.3f} | "
                     f"{r['return_s']:.3f} | {' + '.join(f'{c:.2f}' for c in r['cpu_s'])} | {r['startup_s']:.1f} |")
    lines += ["", f"Baseline (mean of the two {n}-episode one-loop runs): {100 * base:.2f} % overhead."]
    return "\n".join(lines)


if __name__ == "__main__":
    latency = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    print(markdown(measure(latency, n)))
