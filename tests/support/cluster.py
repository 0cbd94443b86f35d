"""Helpers shared by the distributed-run tests: a small on-policy config, the run folder's records, and
waiting for a role to come back."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

from relax_gym.trainer.cluster.run import ClusterTrainer
from relax_gym.trainer.config import load_config
from relax_gym.trainer.loop import Trainer

ROOT = Path(__file__).resolve().parents[2]
WARM_START = ROOT / "examples" / "checkpoints" / "tiny-arithmetic"
STEPS = 4
#: the warm start's own task (sums) in groups of 4: some groups have mixed rewards, so the steps have gradients
GROUP_SIZE, GROUPS_PER_STEP = 4, 3
KEYS = ("reward_mean", "train/loss", "train/grad_norm", "trained_samples")
#: test timings: a stall is found within seconds, not the production two minutes
FAST_HEALTH = ["cluster.health.poll_s=0.2", "cluster.health.stall_s=3", "cluster.health.probe_timeout_s=2"]


def config(run_dir: Path, *overrides: str, cluster: bool = True):
    base = [
        f"run_dir={run_dir}",
        f"model={WARM_START}",
        "envs=[{id: relax/Arithmetic-v0, kwargs: {digits: 1, ops: '+'}}]",
        f"rollout.group_size={GROUP_SIZE}",
        f"rollout.groups_per_step={GROUPS_PER_STEP}",
        "rollout.temperature=0.5",
        "rollout.max_new_tokens=4",
        "rollout.max_turns=1",
        "rollout.engine_max_batch_size=1",
        f"trainer.total_steps={STEPS}",
        "trainer.lr=1e-3",
        "trainer.checkpoint_every=2",
        "trainer.max_staleness=0",
    ]
    if cluster:
        base += ["cluster.mode=ray", "cluster.engines.count=2", "cluster.rollout_workers.count=2",
                 "cluster.control.enabled=false", *FAST_HEALTH]
    return load_config(None, [*base, *overrides])


def records(run_dir: Path, kind: str = "train") -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["type"] == kind]


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def trained_tasks(run_dir: Path) -> Counter:
    """How many trained trajectories each task (its seed) has, from the run's saved trajectories."""
    return Counter(json.loads(line)["seed"] for line in (run_dir / "trajectories.jsonl").read_text().splitlines())


def losses(rows: list[dict]) -> list[list]:
    return [[r[k] for k in KEYS] for r in rows]


def reference_run(tmp_path_factory) -> list[dict]:
    """The uninterrupted in-process run every scenario must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    asyncio.run(Trainer(config(run_dir, cluster=False)).run())
    rows = records(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert any(r["train/grad_norm"] > 0 for r in rows)
    return rows


def train_cluster(cfg, **kwargs) -> dict:
    return asyncio.run(ClusterTrainer(cfg, **kwargs).run())


async def restarted(run: ClusterTrainer, engine_id: str, timeout_s: float = 60) -> None:
    """Waits (holding up the loop, as a slow step would) until the engine is back and serving."""
    async def back() -> None:
        slot = run.fleet.slots[engine_id]
        while not (slot.restarts.total and slot.state == "ACTIVE"):
            await asyncio.sleep(0.1)

    await asyncio.wait_for(back(), timeout_s)


def assert_exactly_once(run_dir: Path, group_size: int = GROUP_SIZE) -> None:
    per_task = trained_tasks(run_dir)
    assert len(per_task) == STEPS * GROUPS_PER_STEP, per_task  # every step trained groups_per_step distinct tasks
    assert set(per_task.values()) == {group_size}, per_task  # each task's group trained once, whole





def engine_with_latency(max_delay_s: float = 0.0, *, hold_until_version: int | None = None,
                        hold_seeds: frozenset[int] = frozenset(), hold_timeout_s: float = 60.0,
                        stop: tuple[str, ...] = (), cold_start_s: float = 0.0) -> type:
    """An `EngineService` for timing-dependent tests, to install as `relax_gym.trainer.cluster.fleet.EngineService`
    (monkeypatch); made in here, so Ray ships it by value to the engine processes (this folder is not on their
    path). It waits a random 0..`max_delay_s` inside each request (counted in flight, as a slow engine's wait
    would be). With `hold_until_version=v`, it holds every request past the first turn of an episode of the tasks
    seeded `hold_seeds` until it has loaded version v (at most `hold_timeout_s`): v's publication then lands
    inside those episodes. `stop` strings end every turn (as `SamplingParams.stop`). `cold_start_s` delays each
    engine process's first probe, as a cold engine's first token on a loaded machine is slow."""
    import dataclasses
    import random

    from relax_gym.trainer.cluster.roles import EngineService

    class LatencyEngine(EngineService):
        async def _maybe_fail(self) -> None:
            await super()._maybe_fail()
            if not hasattr(self, "rng"):
                self.rng = random.Random(self.engine_id)
            await asyncio.sleep(self.rng.random() * max_delay_s)

        async def generate(self, request):
            if stop:
                request = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, stop=stop))
            group, _, turn = (request.rid or "#-1/0/0").rsplit("/", 2)
            if hold_until_version is not None and int(turn) > 0 and int(group.rsplit("#", 1)[1]) in hold_seeds:
                deadline = time.monotonic() + hold_timeout_s
                while self.engine.weight_version < hold_until_version and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
            return await super().generate(request)

        async def probe(self) -> bool:
            if not getattr(self, "probed", False):
                self.probed = True
                await asyncio.sleep(cold_start_s)
            return await super().probe()

    return LatencyEngine
