"""Soak: a distributed run on Ray's multi-node test cluster, its roles and whole nodes killed at random for minutes.

The quickstart's task and warm start (2 engines, 2 rollout workers, the trainer rank; async, `max_staleness: 1`,
a checkpoint every 4 steps) joins, from this process, a cluster of a CPU-less head and three worker nodes
(`ray.cluster_utils.Cluster`: a raylet each, on this machine), and trains until `--minutes` pass. Every `--every`
seconds (0.5x to 1.5x, seeded) comes one fault, drawn at random: an engine killed through Ray, an engine's process
SIGKILLed, a rollout worker killed through Ray, the trainer rank's process SIGKILLed, or a worker node holding a
role removed without grace (a fresh node then joins, so the cluster keeps its size). A fault waits until the
previous one's roles serve again (at most RECOVER_TIMEOUT_S). Then the run is stopped as Ctrl-C stops it.

It reports faults by kind, the recoveries' times (`time_to_recover_s` of events.jsonl), failed restarts, lost and
duplicate groups (every task the run started is trained once with all its members, still pending in the ledger the
last checkpoint saved, or discarded by the data bus), steps, and memory: the resident set of this process (the
controller) and the sum over each role's processes, as means over the first and the last minute.

    python benchmarks/soak.py                   # 10 minutes, a fault every 30 s
    python benchmarks/soak.py --minutes 2 --every 20
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
from pathlib import Path
from statistics import fmean, median
from typing import Any

import psutil
import ray
from ray.cluster_utils import Cluster

from relax_gym.trainer.cluster.run import ClusterTrainer
from relax_gym.trainer.config import TrainConfig, load_config
from relax_gym.trainer.loop import task_of_seed

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent / "runs"
KINDS = ("engine-ray-kill", "engine-sigkill", "worker-kill", "trainer-sigkill", "node-loss")
ROLES = ("EngineService", "RolloutWorker", "TrainerRank")
#: the event that says a role of each kind came back
RECOVERY = {"EngineService": "engine_restarted", "RolloutWorker": "worker_restarted",
            "TrainerRank": "trainer_restarted"}
RECOVER_TIMEOUT_S = 180.0
NODE_CPUS = 3


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def make_config(run_dir: Path, address: str) -> TrainConfig:
    return load_config(ROOT / "examples" / "configs" / "quickstart.yaml", [
        f"run_dir={run_dir}", f"model={ROOT / 'examples' / 'checkpoints' / 'tiny-arithmetic'}",
        "rollout.group_size=4", "rollout.groups_per_step=4", "trainer.total_steps=1000000",
        "trainer.max_staleness=1", "trainer.checkpoint_every=4", "trainer.eval_every=0",
        "cluster.mode=ray", f"cluster.address={address}", "cluster.engines.count=2",
        "cluster.rollout_workers.count=2", "cluster.control.enabled=false",
        "cluster.health.poll_s=0.5", "cluster.health.stall_s=5", "cluster.health.probe_timeout_s=3",
        # a soak spends restarts on purpose: budgets large enough that none runs out
        "cluster.health.engine_restarts=1000", "cluster.health.worker_restarts=1000",
        "cluster.health.max_trainer_restarts=1000",
    ])


def role_of(process: psutil.Process) -> str | None:
    """The role a process runs, from its Ray process title (`ray::Class` or `ray::Class.method`), if any."""
    try:
        titles = [arg[5:].split(".")[0] for arg in process.cmdline() if arg.startswith("ray::")]
    except psutil.Error:
        return None
    return next((t for t in titles if t in ROLES), None)


def role_processes() -> dict[str, list[psutil.Process]]:
    """This machine's role processes by kind."""
    found: dict[str, list[psutil.Process]] = defaultdict(list)
    for process in psutil.process_iter():
        if role := role_of(process):
            found[role].append(process)
    return found


def roles_on(node: Any) -> list[str]:
    """The roles running on a node of the test cluster: its raylet's children's."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    return [role for process in raylet.children(recursive=True) if (role := role_of(process))]


class Soak:
    def __init__(self, cluster: Cluster, run: ClusterTrainer, rng: random.Random, every_s: float):
        self.cluster, self.run, self.rng, self.every_s = cluster, run, rng, every_s
        self.faults: list[tuple[str, float, float | None]] = []  # (kind, at s, back after s)
        self.memory: list[tuple[float, float, dict[str, float]]] = []  # (at s, controller MiB, roles' MiB by kind)
        self.start = time.perf_counter()

    def sample_memory(self) -> None:
        mib = 1024 * 1024
        roles = {kind: sum(p.memory_info().rss for p in procs if p.is_running()) / mib
                 for kind, procs in role_processes().items()}
        self.memory.append((time.perf_counter() - self.start, psutil.Process().memory_info().rss / mib, roles))

    def serving(self) -> bool:
        run = self.run
        return (run._trainer_actor is not None and all(s.state == "ACTIVE" for s in run.fleet.slots.values())
                and all(s.alive for s in run.workers.slots.values()))

    async def fault(self, kind: str) -> Counter[str]:
        """Performs it; returns the recovery events (by name) it must cause."""
        run = self.run
        if kind in ("engine-ray-kill", "engine-sigkill"):
            slot = self.rng.choice(list(run.fleet.slots.values()))
            if kind == "engine-ray-kill":
                ray.kill(slot.actor)
            else:
                os.kill(int((await slot.actor.ready.remote())["pid"]), signal.SIGKILL)
            return Counter({"engine_restarted": 1})
        if kind == "worker-kill":
            ray.kill(self.rng.choice(list(run.workers.slots.values())).actor)
            return Counter({"worker_restarted": 1})
        if kind == "trainer-sigkill":
            for process in role_processes()["TrainerRank"]:
                process.kill()
            return Counter({"trainer_restarted": 1})
        victim = self.rng.choice([n for n in self.cluster.worker_nodes if roles_on(n)])
        lost = Counter(RECOVERY[role] for role in roles_on(victim))
        self.cluster.remove_node(victim, allow_graceful=False)
        self.cluster.add_node(num_cpus=NODE_CPUS)
        return lost

    def back(self, expected: Counter[str]) -> bool:
        """Every role serves, and each recovery a fault must cause has its event."""
        done = self.recovered()
        return self.serving() and all(done[k] >= n for k, n in expected.items())

    def recovered(self) -> Counter[str]:
        return Counter(e["event"] for e in read_jsonl(Path(self.run.cfg.run_dir) / "events.jsonl")
                       if e["event"] in RECOVERY.values())

    async def drive(self, until_s: float) -> None:
        """Samples memory every 5 s; a fault every ~every_s once the previous one's roles serve again."""
        next_fault = self.every_s
        while (now := time.perf_counter() - self.start) < until_s:
            if not self.memory or now - self.memory[-1][0] >= 5:
                self.sample_memory()
            if now >= next_fault and self.run.step > 0:
                kind = self.rng.choice(KINDS)
                before = self.recovered()
                at = time.perf_counter()
                expected = before + await self.fault(kind)

                while not self.back(expected) and time.perf_counter() - at < RECOVER_TIMEOUT_S:
                    await asyncio.sleep(0.2)
                back_s = time.perf_counter() - at if self.back(expected) else None
                self.faults.append((kind, at - self.start, back_s))
                next_fault = time.perf_counter() - self.start + self.every_s * self.rng.uniform(0.5, 1.5)
            await asyncio.sleep(0.5)


def exactly_once(run: ClusterTrainer) -> tuple[int, int]:
    """(lost groups, duplicate groups): each task the run started is trained once by a whole group, or still in
    the ledger (`unfinished`, saved with the last checkpoint, played first on a resume), or one the bus discarded."""
    cfg = run.cfg
    members: Counter[int] = Counter()
    steps: dict[int, set[int]] = defaultdict(set)
    for row in read_jsonl(Path(cfg.run_dir) / "trajectories.jsonl"):
        task = task_of_seed(cfg.seed, int(row["seed"]))
        members[task] += 1
        steps[task].add(int(row["step"]))
    size = cfg.rollout.group_size
    duplicates = [t for t in members if len(steps[t]) > 1 or members[t] > size]
    rows = [r for r in read_jsonl(Path(cfg.run_dir) / "metrics.jsonl") if r["type"] == "train"]
    discarded = int(rows[-1].get("dropped_stale_total", 0)) + int(rows[-1].get("filtered_total", 0)) if rows else 0
    missing = set(range(run.next_task)) - set(members) - set(run.unfinished) - set(run.reissue)
    partial = [t for t in members if t not in duplicates and members[t] < size]
    return max(0, len(missing) - discarded) + len(partial), len(duplicates)


def window(memory: list[tuple[float, float, dict[str, float]]], first: bool) -> dict[str, float]:
    """Mean MiB over the first (or the last) 60 s of samples: the controller and each role kind."""
    end = memory[-1][0]
    rows = [m for m in memory if (m[0] <= 60 if first else m[0] >= end - 60)]
    out = {"controller": fmean(m[1] for m in rows)}
    for kind in ROLES:
        out[kind] = fmean(m[2].get(kind, 0.0) for m in rows)
    return out


async def soak(args: argparse.Namespace) -> int:
    run_dir = OUT / "soak"
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(3):
        cluster.add_node(num_cpus=NODE_CPUS)
    cluster.wait_for_nodes()
    print(f"cluster up in {time.perf_counter() - t0:.1f} s: a CPU-less head and 3 worker nodes of {NODE_CPUS} CPUs",
          flush=True)
    run = ClusterTrainer(make_config(run_dir, cluster.address))
    training = asyncio.create_task(run.run())
    while not hasattr(run, "fleet") or run.step == 0:
        await asyncio.sleep(0.5)
        if training.done():
            await training
    driver = Soak(cluster, run, random.Random(args.seed), args.every)
    await driver.drive(args.minutes * 60)
    training.cancel()  # as Ctrl-C: the running step finishes and is checkpointed
    summary = await training
    lost, duplicates = exactly_once(run)
    events = read_jsonl(run_dir / "events.jsonl")
    failed = Counter(e["event"] for e in events if e["event"].endswith("restart_failed"))
    recoveries: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if "time_to_recover_s" in e:
            recoveries[e["event"]].append(float(e["time_to_recover_s"]))
    first, last = window(driver.memory, True), window(driver.memory, False)
    print(f"\n{args.minutes:g} min, {summary.get('steps', run.step)} steps, {len(driver.faults)} faults "
          f"({', '.join(f'{k} {n}' for k, n in sorted(Counter(f[0] for f in driver.faults).items()))})")
    not_back = [f for f in driver.faults if f[2] is None]
    backs: dict[str, list[float]] = defaultdict(list)
    for kind, _, back in driver.faults:
        if back is not None:
            backs[kind].append(back)
    print(f"every fault's roles serving again: {'yes' if not not_back else f'no: {not_back}'}; after (median s): "
          + ", ".join(f"{k} {median(v):.1f}" for k, v in sorted(backs.items())))
    print("recoveries (events.jsonl, time_to_recover_s mean): " + ", ".join(
        f"{k} {len(v)} x {fmean(v):.1f} s" for k, v in sorted(recoveries.items())))
    print(f"failed restarts: {dict(failed) or 0}")
    print("memory, MiB (first minute -> last minute): " + ", ".join(
        f"{k} {first[k]:.0f} -> {last[k]:.0f}" for k in first))
    print(f"lost groups: {lost}, duplicate groups: {duplicates}")
    ray.shutdown()
    cluster.shutdown()
    return 1 if lost or duplicates or not_back else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between faults, on average")
    parser.add_argument("--seed", type=int, default=0)
    return asyncio.run(soak(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
