"""Chaos: a distributed training run whose roles are killed on a schedule, against the same run left alone.

One local Ray cluster (its start-up time is reported) runs the quickstart's task and warm-start model
(single-digit addition, `examples/checkpoints/tiny-arithmetic`) twice with 2 engines, 2 rollout workers and
trainer rank 0 as actors, checkpointing every 2 steps, with test-like health timings:

1. faulted: a seeded RNG (`--seed`) spreads four kills over the run: one engine killed through Ray (`ray.kill`),
   the other engine SIGKILLed (its process, as the OOM killer would), one rollout worker killed through Ray, and
   the trainer rank's process crashing while it trains a step (`Faults(trainer={"crash_at_step": n})`: the
   controller restarts it from the last checkpoint). A kill waits until the previous one's role is back, so the
   run keeps making progress; the run's last step waits until every killed role is back.
2. unfaulted: the same config in a fresh run folder.

What it reports, from the run folders (`benchmarks/runs/chaos_*`):

- lost groups: tasks the run admitted and never trained (the trained tasks must be exactly tasks 0..N-1, N =
  steps x groups_per_step, plus any the data bus discarded as stale), and groups trained with fewer members than
  `group_size`; duplicate groups: a task trained more than once. Both must be 0 (from trajectories.jsonl).
- failovers (engine calls a router moved to another engine, group calls a dead worker took with it), restarts
  and time to recover per kind (from events.jsonl: the controller's own measure, from the replacement's spawn
  to serving; and this script's, from the kill until the role serves again, which includes finding it dead).
- final reward (mean of the last few steps' reward_mean) and wall time, faulted vs unfaulted, and whether the
  per-step losses are equal: with `max_staleness: 0` (the default here) and one request per engine batch, the
  faulted run trains on exactly the unfaulted run's batches, so they should be.

It ends with exactly one line `lost groups: L, duplicate groups: D` (the faulted run's) and exits 1 if either is
non-zero (in either run) or if a scheduled kill did not happen or its role did not come back.

    python benchmarks/chaos.py --quick            # 10 steps, 4 groups of 4: about a minute on 2 cores
    python benchmarks/chaos.py                    # 50 steps, 8 groups of 8
    python benchmarks/chaos.py --seed 3 --staleness 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean, median
from typing import Any

import ray

from relax_gym.trainer.cluster.run import ClusterTrainer, Faults
from relax_gym.trainer.config import TrainConfig, load_config
from relax_gym.trainer.loop import task_of_seed

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent / "runs"
#: what must match step by step for "the same batches": the tests' parity keys
LOSS_KEYS = ("reward_mean", "train/loss", "train/grad_norm", "trained_samples")
ENGINES = ("engine-0", "engine-1")
WORKERS = ("rollout-0", "rollout-1")
#: how long a killed role may take to serve again before the run is declared broken
RECOVER_TIMEOUT_S = 180.0


@dataclass
class Size:
    steps: int
    group_size: int
    groups_per_step: int


QUICK = Size(steps=10, group_size=4, groups_per_step=4)
FULL = Size(steps=50, group_size=8, groups_per_step=8)


def make_config(run_dir: Path, size: Size, staleness: int) -> TrainConfig:
    return load_config(ROOT / "examples" / "configs" / "quickstart.yaml", [
        f"run_dir={run_dir}",
        f"model={ROOT / 'examples' / 'checkpoints' / 'tiny-arithmetic'}",
        f"rollout.group_size={size.group_size}",
        f"rollout.groups_per_step={size.groups_per_step}",
        "rollout.engine_max_batch_size=1",  # generation independent of request timing: kills cannot change it
        f"trainer.total_steps={size.steps}",
        f"trainer.max_staleness={staleness}",
        "trainer.checkpoint_every=2",
        "trainer.eval_every=0",
        "cluster.mode=ray",
        "cluster.engines.count=2",
        "cluster.rollout_workers.count=2",
        "cluster.control.enabled=false",
        "cluster.health.poll_s=0.5",
        "cluster.health.stall_s=5",
        "cluster.health.probe_timeout_s=3",
    ])


# --- the schedule -------------------------------------------------------------------------
@dataclass
class Kill:
    """One scheduled kill: `kind` at the first logged step >= `step` (the trainer crash: while training `step`)."""

    kind: str  # engine-ray-kill | engine-sigkill | worker-kill | trainer-crash
    step: int
    target: str
    done_at_step: int | None = None
    #: seconds from the kill until the role served again (measured here), None while it has not
    back_after_s: float | None = None
    failed: str | None = None
    watcher: asyncio.Task | None = field(default=None, repr=False)


def plan(rng: random.Random, steps: int, checkpoint_every: int) -> list[Kill]:
    """Four kills in random order, one in each quarter of steps 2..steps-2; the trainer crash comes after the
    first checkpoint (so it resumes from one rather than from the initial weights)."""
    kinds = ["engine-ray-kill", "engine-sigkill", "worker-kill", "trainer-crash"]
    rng.shuffle(kinds)
    lo, hi = 2, max(steps - 2, 5)
    edges = [lo + round(i * (hi - lo + 1) / 4) for i in range(5)]
    at = [rng.randrange(edges[i], max(edges[i + 1], edges[i] + 1)) for i in range(4)]
    if kinds.index("trainer-crash") == 0 and at[0] <= checkpoint_every:
        kinds[0], kinds[1] = kinds[1], kinds[0]  # the crash goes second: past the first checkpoint
    by_engine = rng.sample(ENGINES, 2)  # which engine ray.kill takes, and which is SIGKILLed
    targets = {"engine-ray-kill": by_engine[0], "engine-sigkill": by_engine[1], "worker-kill": rng.choice(WORKERS),
               "trainer-crash": "trainer-0"}
    kills = [Kill(kind, step, targets[kind]) for kind, step in zip(kinds, at, strict=True)]
    for kill in kills:
        if kill.kind == "trainer-crash":
            kill.step = max(kill.step, checkpoint_every + 1)
    return sorted(kills, key=lambda k: k.step)


class Chaos:
    """The `on_step` hook: performs the due kills, one role down at a time."""

    def __init__(self, kills: list[Kill]):
        self.kills = kills
        self.restarts_seen = 0

    async def __call__(self, run: ClusterTrainer) -> None:
        crash = next((k for k in self.kills if k.kind == "trainer-crash"), None)
        if crash is not None and crash.done_at_step is None and run.trainer_restarts > self.restarts_seen:
            crash.done_at_step = crash.step  # it happened while that step trained; the loop resumed since
        self.restarts_seen = run.trainer_restarts
        last = run.step >= run.cfg.trainer.total_steps
        for kill in self.kills:
            if kill.done_at_step is not None or kill.kind == "trainer-crash":
                continue
            if kill.step > run.step:
                break
            await self.settle()  # the previous victim serves again before the next one goes down
            await self.perform(run, kill)
        if last or (crash is not None and crash.done_at_step is None and crash.step == run.step + 1):
            await self.settle()  # the run ends (or its trainer crashes) with every killed role back

    async def settle(self) -> None:
        for kill in self.kills:
            if kill.watcher is not None:
                await kill.watcher

    async def perform(self, run: ClusterTrainer, kill: Kill) -> None:
        if kill.kind == "worker-kill":
            slot: Any = run.workers.slots[kill.target]
            old = slot.actor
            ray.kill(old)

            def back() -> bool | None:
                return None if slot.retired else (slot.actor is not old and slot.alive)
        else:
            slot = run.fleet.slots[kill.target]
            old = slot.actor
            if kill.kind == "engine-ray-kill":
                ray.kill(old)
            else:
                pid = int((await old.ready.remote())["pid"])
                os.kill(pid, signal.SIGKILL)

            def back() -> bool | None:
                return None if slot.retired else (slot.actor is not old and slot.state == "ACTIVE")
        kill.done_at_step = run.step
        kill.watcher = asyncio.create_task(self.watch(kill, back, time.perf_counter()))

    @staticmethod
    async def watch(kill: Kill, back: Any, killed_at: float) -> None:
        deadline = killed_at + RECOVER_TIMEOUT_S
        while time.perf_counter() < deadline:
            state = back()
            if state is None:
                kill.failed = f"{kill.target} was retired (its restart budget spent)"
                return
            if state:
                kill.back_after_s = time.perf_counter() - killed_at
                return
            await asyncio.sleep(0.05)
        kill.failed = f"{kill.target} not serving again {RECOVER_TIMEOUT_S:g} s after the kill"


# --- one run ------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def train(cfg: TrainConfig, faults: Faults | None, chaos: Chaos | None) -> tuple[float, float]:
    """Runs it in a fresh folder; returns (wall s, s until the first step was logged: start-up and step 1)."""
    run_dir = Path(cfg.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a leftover checkpoint would make this a resumed run
    first: list[float] = []

    async def on_step(run: ClusterTrainer) -> None:
        if not first:
            first.append(time.perf_counter() - start)
        if chaos is not None:
            await chaos(run)

    start = time.perf_counter()
    asyncio.run(ClusterTrainer(cfg, faults=faults, on_step=on_step).run())
    return time.perf_counter() - start, first[0] if first else float("nan")


def exactly_once(run_dir: Path, cfg: TrainConfig, discarded: int) -> tuple[int, int, list[str]]:
    """(lost groups, duplicate groups, what is wrong) from trajectories.jsonl: the trained tasks must be exactly
    tasks 0..N-1 (N = steps x groups_per_step + groups discarded), each trained once with group_size members."""
    r = cfg.rollout
    members: Counter[int] = Counter()
    steps: dict[int, set[int]] = defaultdict(set)
    for row in read_jsonl(run_dir / "trajectories.jsonl"):
        task = task_of_seed(cfg.seed, int(row["seed"]))
        members[task] += 1
        steps[task].add(int(row["step"]))
    n = cfg.trainer.total_steps * r.groups_per_step + discarded
    duplicates = sorted(t for t in members if len(steps[t]) > 1 or members[t] > r.group_size)
    partial = sorted(t for t in members if t not in duplicates and members[t] < r.group_size)
    missing = sorted(set(range(n)) - set(members))
    outside = sorted(t for t in members if not 0 <= t < n)
    lost = max(0, len(missing) - discarded) + len(partial)
    notes = []
    if duplicates:
        notes.append(f"tasks trained more than once: {duplicates[:10]}")
    if partial:
        notes.append(f"groups trained with fewer than {r.group_size} members: "
                     f"{ {t: members[t] for t in partial[:10]} }")
    if len(missing) > discarded:
        notes.append(f"tasks never trained: {missing[:10]} ({discarded} discarded by the data bus)")
    if outside:
        notes.append(f"tasks trained beyond task {n - 1}: {outside[:10]}")
    return lost, len(duplicates), notes


def summarize(name: str, cfg: TrainConfig, times: tuple[float, float]) -> dict[str, Any]:
    wall_s, first_step_s = times
    run_dir = Path(cfg.run_dir)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["type"] == "train"]
    events = read_jsonl(run_dir / "events.jsonl")
    last = rows[-1] if rows else {}
    discarded = int(last.get("dropped_stale_total", 0)) + int(last.get("filtered_total", 0))
    lost, dups, notes = exactly_once(run_dir, cfg, discarded)
    steps = [r["step"] for r in rows]
    if steps != list(range(1, cfg.trainer.total_steps + 1)):
        notes.append(f"logged steps are not 1..{cfg.trainer.total_steps} once each: {steps}")
    statuses = Counter({k: 0 for k in ("aborted", "failed")})
    for r in rows:
        statuses.update(r["status"])
    few = max(3, len(rows) // 10)
    recover: dict[str, list[float]] = {}
    for kind in ("engine", "worker", "trainer"):
        recover[kind] = [float(e["time_to_recover_s"]) for e in events if e["event"] == f"{kind}_restarted"]
    return {
        "name": name, "run_dir": run_dir, "wall_s": wall_s, "first_step_s": first_step_s,
        "rest_s": wall_s - first_step_s, "rows": rows, "events": events,
        "lost": lost, "duplicates": dups, "notes": notes, "discarded": discarded,
        "final_reward": fmean(r["reward_mean"] for r in rows[-few:]) if rows else float("nan"), "last_n": few,
        "engine_failovers": int(last.get("cluster/engine_failovers", 0)),
        "lost_worker_calls": int(last.get("cluster/lost_worker_calls", 0)),
        "probe_failures": int(last.get("cluster/probe_failures", 0)),
        "recover": recover, "aborted_failed": f"{statuses['aborted']} / {statuses['failed']}",
        "event_counts": Counter(e["event"] for e in events),
    }


# --- checking the schedule ----------------------------------------------------------------
def check_kills(kills: list[Kill], faulted: dict[str, Any]) -> list[str]:
    """What did not happen as scheduled: a kill not performed, its role not back, no event recording it."""
    problems = []
    events = faulted["events"]
    for kill in kills:
        label = f"{kill.kind} of {kill.target} at step {kill.step}"
        if kill.done_at_step is None:
            problems.append(f"{label}: not performed")
        elif kill.failed:
            problems.append(f"{label}: {kill.failed}")
        elif kill.kind == "trainer-crash":
            if not any(e["event"] == "trainer_restarted" and e["lost_at_step"] == kill.step - 1 for e in events):
                problems.append(f"{label}: no trainer_restarted event lost at step {kill.step - 1}")
        else:
            kind, key = ("worker", "worker_id") if kill.kind == "worker-kill" else ("engine", "engine_id")
            if not any(e["event"] == f"{kind}_restarted" and e.get(key) == kill.target for e in events):
                problems.append(f"{label}: no {kind}_restarted event for {kill.target}")
    return problems


# --- report -------------------------------------------------------------------------------
def seconds(values: list[float]) -> str:
    if not values:
        return "–"
    return ", ".join(f"{v:.2f}" for v in values) if len(values) <= 3 else f"median {median(values):.2f}"


def markdown(kills: list[Kill], faulted: dict[str, Any], clean: dict[str, Any], ray_s: float, args: Any,
             size: Size) -> str:
    lines = [
        f"{size.steps} steps, {size.groups_per_step} groups of {size.group_size} per step, max_staleness "
        f"{args.staleness}, schedule seed {args.seed}; Ray start-up {ray_s:.1f} s.", "",
        "| kill | scheduled step | done after step | kill → serving again (s) |",
        "|---|---:|---:|---:|",
    ]
    for k in kills:
        back = "(restart, see below)" if k.kind == "trainer-crash" else (
            f"{k.back_after_s:.2f}" if k.back_after_s is not None else f"never: {k.failed}")
        done = f"{k.step} (crashed training it)" if k.kind == "trainer-crash" and k.done_at_step else k.done_at_step
        lines.append(f"| {k.kind} {k.target} | {k.step} | {done} | {back} |")
    lines += ["", "| | faulted | unfaulted |", "|---|---:|---:|"]

    def row(label: str, key: str, fmt: str = "{}") -> None:
        lines.append(f"| {label} | {fmt.format(faulted[key])} | {fmt.format(clean[key])} |")

    row("lost groups", "lost")
    row("duplicate groups", "duplicates")
    row("engine failovers (router)", "engine_failovers")
    row("lost worker calls (played again)", "lost_worker_calls")
    row("aborted / failed episodes trained", "aborted_failed")
    for kind in ("engine", "worker", "trainer"):
        lines.append(f"| {kind} restarts | {len(faulted['recover'][kind])} | {len(clean['recover'][kind])} |")
        lines.append(f"| {kind} time to recover (s, controller's) | {seconds(faulted['recover'][kind])} | "
                     f"{seconds(clean['recover'][kind])} |")
    lines.append(f"| final reward (mean of last {faulted['last_n']} steps) | {faulted['final_reward']:.3f} | "
                 f"{clean['final_reward']:.3f} |")
    row("wall s", "wall_s", "{:.1f}")
    row("of which start-up and step 1 s", "first_step_s", "{:.1f}")
    row(f"of which steps 2..{size.steps} s", "rest_s", "{:.1f}")
    lines += ["", f"Wall time faulted / unfaulted: {faulted['wall_s'] / clean['wall_s']:.2f}x "
              f"(steps 2..{size.steps} only: {faulted['rest_s'] / clean['rest_s']:.2f}x)."]
    return "\n".join(lines)


def losses_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def key(rows: list[dict[str, Any]]) -> list[list[Any]]:
        return [[r.get(k) for k in LOSS_KEYS] for r in rows]

    return bool(a["rows"]) and key(a["rows"]) == key(b["rows"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.steps} steps, groups of {QUICK.group_size}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--staleness", type=int, default=0, help="trainer.max_staleness (0: exact parity)")
    parser.add_argument("--steps", type=int, default=None, help="override the number of steps")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    if args.steps is not None:
        size = Size(args.steps, size.group_size, size.groups_per_step)
    if size.steps < 6:
        parser.error("--steps must be at least 6 (four kills spread over the run)")

    t0 = time.perf_counter()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    ray_s = time.perf_counter() - t0
    try:
        faulted_cfg = make_config(OUT / "chaos_faulted", size, args.staleness)
        kills = plan(random.Random(args.seed), size.steps, faulted_cfg.trainer.checkpoint_every)
        print("kill schedule: " + "; ".join(f"{k.kind} {k.target} at step {k.step}" for k in kills), flush=True)
        crash = next(k for k in kills if k.kind == "trainer-crash")
        chaos = Chaos(kills)
        faulted = summarize("faulted", faulted_cfg,
                            train(faulted_cfg, Faults(trainer={"crash_at_step": crash.step}), chaos))
        clean_cfg = make_config(OUT / "chaos_unfaulted", size, args.staleness)
        clean = summarize("unfaulted", clean_cfg, train(clean_cfg, None, None))
    finally:
        ray.shutdown()

    problems = check_kills(kills, faulted)
    print()
    print(markdown(kills, faulted, clean, ray_s, args, size))
    print()
    for run in (faulted, clean):
        for note in run["notes"]:
            print(f"{run['name']}: {note}")
        print(f"{run['name']}: events {dict(sorted(run['event_counts'].items()))}")
    for problem in problems:
        print(f"schedule: {problem}")
    print(f"losses equal to the unfaulted run: {'yes' if losses_equal(faulted, clean) else 'no'}")
    print(f"lost groups: {faulted['lost']}, duplicate groups: {faulted['duplicates']}")
    bad = faulted["lost"] or faulted["duplicates"] or clean["lost"] or clean["duplicates"] or problems
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
