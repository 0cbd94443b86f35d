"""Async vs sync training: one task, model and seed in sync mode and with max_staleness in {1, 2, 4}.

For each mode: mean step time, speedup over sync, efficiency, and the final
reward (train reward over the last tenth of steps, and a greedy eval on
held-out tasks). T_rollout and T_train are measured in the sync run, where the
two phases do not overlap: T_rollout is the time spent generating a step's
groups, T_train the time spent on logprobs, the update and the weight push.
Efficiency = max(T_rollout, T_train) / T_async_step: 1.0 means async hides the
shorter phase entirely behind the longer one.

    python benchmarks/async_vs_sync.py [STEPS] [ENV_LATENCY_S]

ENV_LATENCY_S adds a delay to every env step (a remote judge or tool), which
makes rollouts wait rather than compute: on a 2-core CPU both phases otherwise
compete for the same cores, which no schedule can hide.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from statistics import fmean

import relax_gym
from relax_gym.envs.procedural import ArithmeticEnv
from relax_gym.trainer.config import load_config
from relax_gym.trainer.loop import Trainer

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent


class JudgedArithmetic(ArithmeticEnv):
    """Arithmetic whose grading waits `latency_s`, like a call to a remote judge."""

    latency_s = 0.0
    blocking = True  # it waits: off the event loop, unlike the arithmetic it extends

    def step(self, action):
        time.sleep(self.latency_s)
        return super().step(action)


def run_mode(mode: str, staleness: int, steps: int, env_id: str) -> dict:
    run_dir = OUT / "runs" / f"{mode}_k{staleness}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cfg = load_config(ROOT / "examples" / "configs" / "quickstart.yaml", [
        f"run_dir={run_dir}", f"model={ROOT / 'examples/checkpoints/tiny-arithmetic'}",
        f"envs=[{{id: {env_id}, kwargs: {{digits: 1, n_terms: 2, ops: '+'}}}}]",
        f"trainer.mode={mode}", f"trainer.max_staleness={staleness}", f"trainer.total_steps={steps}",
        f"trainer.eval_every={steps}", "trainer.checkpoint_every=100000", "trainer.lr=3e-4",
        "rollout.temperature=0.7",
    ])
    start = time.perf_counter()
    asyncio.run(Trainer(cfg).run())
    wall = time.perf_counter() - start
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["type"] == "train"]
    evals = [r for r in rows if r["type"] == "eval"]
    tenth = max(1, len(train) // 10)
    steady = train[tenth:]  # leave out the first steps (warm-up, first batch)
    return {
        "mode": mode if mode == "sync" else f"async k={staleness}",
        "wall_s": wall,
        "step_s": fmean(r["step_time_s"] for r in steady),
        "rollout_s": fmean(r["wait_rollout_s"] for r in steady),
        "train_s": fmean(r["logprobs_s"] + r["train_s"] + r["weight_sync_s"] for r in steady),
        "reward_last_tenth": fmean(r["reward_mean"] for r in train[-tenth:]),
        "eval_reward": evals[-1]["reward_mean"] if evals else float("nan"),
        "curve": [(r["step"], r["reward_mean"]) for r in train],
    }


def measure(steps: int, env_latency_s: float) -> list[dict]:
    JudgedArithmetic.latency_s = env_latency_s
    relax_gym.register("bench/JudgedArithmetic-v0", JudgedArithmetic)
    results = [run_mode("sync", 0, steps, "bench/JudgedArithmetic-v0")]
    results += [run_mode("async", k, steps, "bench/JudgedArithmetic-v0") for k in (1, 2, 4)]
    sync = results[0]
    bound = max(sync["rollout_s"], sync["train_s"])
    for r in results:
        r["speedup"] = sync["step_s"] / r["step_s"]
        r["efficiency"] = bound / r["step_s"]
    return results


def markdown(results: list[dict], steps: int, env_latency_s: float) -> str:
    sync = results[0]
    lines = [
        f"{steps} steps per mode, quickstart task and model, seed 0, env step latency {env_latency_s} s. "
        f"Sync phases: T_rollout {sync['rollout_s']:.3f} s, T_train {sync['train_s']:.3f} s per step.", "",
        "| mode | step s | speedup over sync | efficiency max(T_rollout, T_train)/T_step | "
        "train reward (last tenth) | eval reward (greedy) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['mode']} | {r['step_s']:.3f} | {r['speedup']:.2f}× | {r['efficiency']:.2f} | "
                     f"{r['reward_last_tenth']:.3f} | {r['eval_reward']:.3f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps, rewards = zip(*r["curve"], strict=True)
        window = max(1, len(rewards) // 10)
        smooth = [fmean(rewards[max(0, i - window + 1): i + 1]) for i in range(len(rewards))]
        left.plot(steps, smooth, label=r["mode"])
    left.set(xlabel="step", ylabel=f"train reward (moving mean of {window})", title="reward per step")
    left.legend()
    left.grid(alpha=0.3)
    names = [r["mode"] for r in results]
    right.bar(names, [r["step_s"] for r in results], color=["grey"] + ["tab:blue"] * (len(results) - 1))
    right.axhline(max(results[0]["rollout_s"], results[0]["train_s"]), ls="--", color="k",
                  label="max(T_rollout, T_train)")
    right.set(ylabel="seconds per step", title="step time")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    latency = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    res = measure(n, latency)
    print(markdown(res, n, latency))
    print(f"plot: {plot(res, OUT / f'async_vs_sync_latency{latency}.png')}")
