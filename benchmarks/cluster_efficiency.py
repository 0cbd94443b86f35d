"""A short training run in one process vs as a Ray cluster run: async efficiency, transport overhead, start-up
and the cost of publishing weights through the object store.

The quickstart's task and warm-start model (single-digit addition, `examples/checkpoints/tiny-arithmetic`),
`trainer.max_staleness=1` (0 in sync mode, which requires it), eval off, checkpoints only at the end, STEPS steps
(default 20), six runs in the same invocation and the same Ray cluster (started first, so its idle processes weigh
on every run alike):

- in-process: `Trainer` (engine, backend and rollout manager in this process), `trainer.mode=sync` and `async`;
- cluster: `ClusterTrainer` with `cluster.mode=ray cluster.engines.count=1 cluster.rollout_workers.count=1
  cluster.control.enabled=false` (engine, rollout worker and trainer rank 0 as separate actors, this process the
  controller), `trainer.mode=sync` and `async`. Weights go through the object store (`cluster.weight_sync`'s
  default).
- the control: the in-process runs again with torch at 1 thread in this process (`torch.set_num_threads(1)`), as
  each 0.5-CPU actor of the cluster run gets (Ray sets OMP_NUM_THREADS from an actor's CPUs, at least 1), so the
  thread count can be told apart from the transport.

What the metrics rows' timings are (`Trainer._train_on`, `RunLog.step`), per step:

- `wait_rollout_s`: how long the loop waited for the step's groups. Sync: the whole generation of the step's
  groups (nothing overlaps it). Async: only the part of generation that training did not hide.
- `logprobs_s`: old / reference / teacher logprobs before the update (none here: `recompute_old_logprobs: false`,
  no KL, no teacher; a few microseconds).
- `train_s`: the optimizer step (`backend.train_step`; a call to the trainer rank's actor in a cluster run).
- `weight_sync_s`: the trained weights to the engine(s) (`_push_weights`): in one process, pause the engine
  between batches, copy the state dict, load it, resume; in a cluster run, the trainer rank's answer to
  `hf_state_dict` stays in the object store and every engine actor loads it from there (pause, load, resume).
- `step_time_s`: time between this step's metrics line and the previous one (the first step's counts from the
  run log's creation, so it holds the start-up: it is left out of every mean below).

The figures, means over steps 2..STEPS:

- T_step = step_time_s of the async run;
- T_rollout = wait_rollout_s of the sync run of the same transport (the step's generation, nothing overlapping);
- T_train = logprobs_s + train_s + weight_sync_s of the sync run of the same transport (the training side of the
  loop's critical path);
- efficiency = max(T_rollout, T_train) / T_step: 1.0 means async hides the shorter phase entirely (the
  convention of `async_vs_sync.py`; in an async run's own rows rollout time is only visible where it was not
  hidden, so its phases are taken from the sync run).
- transport overhead: steps/s of the async runs, cluster / in-process, over the whole run (from the constructor to the
  last step, start-up included) and over steps 2..STEPS (metrics' `time_s`, so without start-up and step 1).
- start-up: `ray.init`; each trainer's constructor (both load and check the policy in this process; a cluster
  run builds its roles later); `_connect` (in a cluster run: the trainer rank, the engine synced to the initial
  weights and the rollout worker started, as the run's "cluster: ... started in X s" line says; in one process
  a no-op); and step 1 alone (from the end of `_connect` to its metrics line).
- weight publication: `weight_sync_s` per step of each transport, split into getting the weights
  (`backend.hf_state_dict`: a copy in one process; in a cluster run `hf_state_dict_ref`: the trainer rank's copy,
  left in the object store) and loading them into the engine(s) (in one process the engine's `pause` +
  `update_weights`; in a cluster run `fleet.publish`: the engine actors' loads, plus a `ray.put` only when the
  fleet is handed a state dict, timed apart by wrapping the fleet module's `ray` in this process).
- diagnostics: the mean per-episode `generate_s` from trajectories.jsonl (the episode's time waiting on its engine:
  transport, queueing and generation); per group, the latency of its `run_group` call as the loop sees it (the
  rollout manager's in one process, the worker pool's in a cluster run, timed by wrapping it) beside its slowest
  episode's `generate_s` (the difference: the manager's own work, and in a cluster run the worker call); and
  after each cluster run a trivial call's round trip from the controller to each role's actor (the worker's and
  engine's `stats`, the trainer rank's `get_version`; median of RTT_CALLS).

    python benchmarks/cluster_efficiency.py [STEPS]
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from statistics import fmean, median
from typing import Any

import ray
import torch

import relax_gym.trainer.cluster.fleet as fleet_module
from relax_gym.trainer.cluster.run import ClusterTrainer
from relax_gym.trainer.config import TrainConfig, load_config
from relax_gym.trainer.loop import Trainer

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent / "runs"
#: trivial calls per role for the round-trip figure
RTT_CALLS = 20
CLUSTER = ["cluster.mode=ray", "cluster.engines.count=1", "cluster.rollout_workers.count=1",
           "cluster.control.enabled=false"]


def make_config(name: str, mode: str, steps: int, cluster: bool) -> TrainConfig:
    return load_config(ROOT / "examples" / "configs" / "quickstart.yaml", [
        f"run_dir={OUT / name}", f"model={ROOT / 'examples' / 'checkpoints' / 'tiny-arithmetic'}",
        f"trainer.mode={mode}", f"trainer.max_staleness={1 if mode == 'async' else 0}",
        f"trainer.total_steps={steps}", "trainer.eval_every=0", "trainer.checkpoint_every=100000",
        *(CLUSTER if cluster else []),
    ])


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return wrapper


def _timed_async(fn: Callable[..., Awaitable[Any]], into: list[float]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return wrapper


class Clock:
    """What the script times around a run (the rows have the rest)."""

    def __init__(self) -> None:
        self.connect_s = float("nan")
        self.connected_at = float("nan")
        self.first_step_at = float("nan")
        self.get_weights_s: list[float] = []  # the weights from the trainer (a state dict, or its ObjectRef)
        self.load_weights_s: list[float] = []  # into the engine(s), per publication after start-up
        self.put_s: list[float] = []  # of which the controller's ray.put (cluster runs)
        self.rtt_s: dict[str, list[float]] = {}  # a trivial call to each role's actor, after the run (cluster runs)
        self.state_dict_mb = float("nan")
        #: per group played: (its call's latency as the loop sees it, its slowest episode's generate_s)
        self.groups: list[tuple[float, float]] = []

    def group_timer(self, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            group = await fn(*args, **kwargs)
            self.groups.append((time.perf_counter() - t0, max(t.metrics.get("generate_s", 0.0) for t in group)))
            return group

        return wrapper


async def _timed_start(connect: Callable[[], Awaitable[None]]) -> Clock:
    """A fresh clock, with how long `connect` (the run's start-up) took."""
    clock = Clock()
    t0 = time.perf_counter()
    await connect()
    clock.connected_at = time.perf_counter()
    clock.connect_s = clock.connected_at - t0
    return clock


class TimedTrainer(Trainer):
    """The in-process run, with its start-up and weight push timed from outside."""

    clock: Clock

    async def _connect(self) -> None:
        self.clock = await _timed_start(super()._connect)
        state = self.backend.hf_state_dict()
        self.clock.state_dict_mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
        backend: Any = self.backend
        backend.hf_state_dict = _timed(backend.hf_state_dict, self.clock.get_weights_s)
        engine: Any = self.engine
        pause_s: list[float] = []
        update_s: list[float] = []
        engine.pause = _timed_async(engine.pause, pause_s)
        engine.update_weights = _timed_async(engine.update_weights, update_s)
        self._pause_s, self._update_s = pause_s, update_s
        manager: Any = self.manager
        manager.run_group = self.clock.group_timer(manager.run_group)

    async def _after_step(self) -> None:
        if self.clock.first_step_at != self.clock.first_step_at:  # nan: the first step
            self.clock.first_step_at = time.perf_counter()
        await super()._after_step()

    async def _close_engine(self) -> None:
        self.clock.load_weights_s = [p + u for p, u in zip(self._pause_s, self._update_s, strict=False)]
        await super()._close_engine()


class TimedCluster(ClusterTrainer):
    """The cluster run, with its start-up and weight publication timed from outside (nothing in it changed)."""

    clock: Clock

    async def _connect(self) -> None:
        self.clock = await _timed_start(super()._connect)
        remote: Any = self.remote  # publication asks the trainer rank for an ObjectRef of its weights
        fleet: Any = self.fleet
        remote.hf_state_dict_ref = _timed(remote.hf_state_dict_ref, self.clock.get_weights_s)
        fleet.publish = _timed_async(fleet.publish, self.clock.load_weights_s)
        workers: Any = self.workers
        workers.run_group = self.clock.group_timer(workers.run_group)
        module: Any = fleet_module
        module.ray = _TimedRay(self.clock.put_s)  # the fleet's `ray.put`, timed (the module, not the code)

    async def _close_engine(self) -> None:
        module: Any = fleet_module
        module.ray = ray
        if hasattr(self, "workers") and hasattr(self, "fleet"):  # the roles idle now: a plain call's round trip
            roles = {"worker": next(iter(self.workers.slots.values())).actor.stats,
                     "engine": next(iter(self.fleet.slots.values())).actor.stats,
                     "trainer": self._trainer_actor.ready}
            for role, method in roles.items():
                for _ in range(RTT_CALLS):
                    t0 = time.perf_counter()
                    await method.remote()
                    self.clock.rtt_s.setdefault(role, []).append(time.perf_counter() - t0)
        await super()._close_engine()

    async def _after_step(self) -> None:
        if self.clock.first_step_at != self.clock.first_step_at:
            self.clock.first_step_at = time.perf_counter()
        await super()._after_step()


class _TimedRay:
    """`ray` as the fleet module sees it, with `put` timed."""

    def __init__(self, into: list[float]):
        self.put = _timed(ray.put, into)

    def __getattr__(self, name: str) -> Any:
        return getattr(ray, name)


def _episode_mean(run_dir: Path, key: str) -> float:
    rows = [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines() if x.strip()]
    return fmean(float(r["metrics"][key]) for r in rows)


def run_one(name: str, mode: str, steps: int, cluster: bool, threads: int | None = None) -> dict[str, Any]:
    """One run; `threads` sets torch's threads in this process for an in-process run (then restores them)."""
    cfg = make_config(name, mode, steps, cluster)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run_one(cfg, name, mode, steps, cluster)
    finally:
        torch.set_num_threads(before)


def _run_one(cfg: TrainConfig, name: str, mode: str, steps: int, cluster: bool) -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    trainer: TimedTrainer | TimedCluster = TimedCluster(cfg) if cluster else TimedTrainer(cfg)
    started = time.perf_counter()
    asyncio.run(trainer.run())
    end = time.perf_counter()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if r["type"] == "train"]
    assert len(train) == steps, f"{name}: {len(train)} steps logged, expected {steps}"
    steady = train[1:]
    c = trainer.clock
    last_step_at = c.first_step_at + (train[-1]["time_s"] - train[0]["time_s"])
    return {
        "name": name, "mode": mode, "cluster": cluster, "steps": steps,
        "init_s": started - t0, "connect_s": c.connect_s, "step1_s": c.first_step_at - c.connected_at,
        "run_to_step1_s": c.first_step_at - started, "wall_s": end - t0,
        "steps_per_s_all": steps / (last_step_at - t0),
        "steps_per_s_steady": (steps - 1) / (train[-1]["time_s"] - train[0]["time_s"]),
        "step_s": fmean(r["step_time_s"] for r in steady),
        "wait_rollout_s": fmean(r["wait_rollout_s"] for r in steady),
        "train_side_s": fmean(r["logprobs_s"] + r["train_s"] + r["weight_sync_s"] for r in steady),
        "logprobs_s": fmean(r["logprobs_s"] for r in steady),
        "train_s": fmean(r["train_s"] for r in steady),
        "weight_sync_s": [r["weight_sync_s"] for r in steady],
        # the timers see one publication per step after start-up (steps 1..N): steps 2..N are [1:]
        "get_weights_s": c.get_weights_s[1:], "load_weights_s": c.load_weights_s[1:], "put_s": c.put_s[1:],
        "state_dict_mb": c.state_dict_mb, "rtt_ms": {k: 1000 * median(v) for k, v in c.rtt_s.items()},
        "generate_s_per_episode": _episode_mean(run_dir, "generate_s"),
        "group_call_s": fmean(g[0] for g in c.groups), "group_generate_s": fmean(g[1] for g in c.groups),
        "reward_last_5": fmean(r["reward_mean"] for r in train[-5:]),
    }


def torch_threads_in_actor() -> int:
    """torch's threads in an actor of the cluster run's size (0.5 CPU): Ray sets OMP_NUM_THREADS from num_cpus."""

    def threads() -> int:
        import torch as t

        return int(t.get_num_threads())

    return int(ray.get(ray.remote(threads).options(num_cpus=0.5).remote()))


def measure(steps: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    ray_s = time.perf_counter() - t0
    try:
        actor_threads = torch_threads_in_actor()
        runs = [run_one("eff_inproc_async", "async", steps, False), run_one("eff_cluster_async", "async", steps, True),
                run_one("eff_inproc_sync", "sync", steps, False), run_one("eff_cluster_sync", "sync", steps, True),
                # the control: one torch thread, as each 0.5-CPU actor of the cluster run has
                run_one("eff_inproc1_async", "async", steps, False, threads=1),
                run_one("eff_inproc1_sync", "sync", steps, False, threads=1)]
    finally:
        ray.shutdown()
    return {"steps": steps, "ray_init_s": ray_s, "runs": {r["name"]: r for r in runs},
            "threads": {"driver": torch.get_num_threads(), "actor": actor_threads}}


def _ms(xs: list[float]) -> str:
    return f"{1000 * fmean(xs):.1f} / {1000 * median(xs):.1f}" if xs else "–"


def markdown(res: dict[str, Any]) -> str:
    r = res["runs"]
    steps = res["steps"]
    #: (label, async run, sync run); the cluster last
    pairs = [("in-process", r["eff_inproc_async"], r["eff_inproc_sync"]),
             ("in-process, 1 torch thread", r["eff_inproc1_async"], r["eff_inproc1_sync"]),
             ("cluster (Ray)", r["eff_cluster_async"], r["eff_cluster_sync"])]
    out = [f"{steps} steps per run, quickstart task and model, seed 0, max_staleness 1 (async), eval off. `ray.init`: "
           f"{res['ray_init_s']:.1f} s. torch threads: {res['threads']['driver']} in this process (the in-process "
           f"run), {res['threads']['actor']} in a 0.5-CPU actor (the cluster's roles). Means over steps 2..{steps}.",
           "", "Async efficiency (T_rollout, T_train from the sync run of the same transport):", "",
           "| transport | T_rollout s | T_train s | T_step async s | T_step sync s | efficiency "
           "max(T_rollout, T_train)/T_step | async speedup over sync | async wait share | generate s per episode "
           "(sync / async) | group call s − its slowest generate s (sync / async) | reward (last 5, async) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, a, s in pairs:
        eff = max(s["wait_rollout_s"], s["train_side_s"]) / a["step_s"]
        out.append(f"| {name} | {s['wait_rollout_s']:.3f} | {s['train_side_s']:.3f} | {a['step_s']:.3f} | "
                   f"{s['step_s']:.3f} | {eff:.2f} | {s['step_s'] / a['step_s']:.2f}× | "
                   f"{a['wait_rollout_s'] / a['step_s']:.2f} | {s['generate_s_per_episode']:.3f} / "
                   f"{a['generate_s_per_episode']:.3f} | {s['group_call_s']:.3f} − {s['group_generate_s']:.3f} / "
                   f"{a['group_call_s']:.3f} − {a['group_generate_s']:.3f} | {a['reward_last_5']:.3f} |")
    (_, ia, is_), (_, i1a, i1s), (_, ca, cs) = pairs
    out += ["", "Transport overhead and start-up (async runs; the sync runs' in brackets):", "",
            "| | in-process | in-process, 1 thread | cluster (Ray) | cluster / in-process | cluster / in-process "
            "1 thread |", "|---|---:|---:|---:|---:|---:|"]

    def row(label: str, key: str, fmt: str, ratio: bool = True) -> str:
        cells = [f"{a[key]:{fmt}} ({s[key]:{fmt}})" for _, a, s in pairs]
        ratios = [f"{ca[key] / a[key]:.2f}x ({cs[key] / s[key]:.2f}x)" if ratio else "" for a, s in ((ia, is_),
                                                                                                     (i1a, i1s))]
        return f"| {label} | {' | '.join(cells)} | {' | '.join(ratios)} |"

    out += [row("steps/s, whole run (start-up included)", "steps_per_s_all", ".2f"),
            row(f"steps/s, steps 2..{steps}", "steps_per_s_steady", ".2f"),
            row("train_s per step", "train_s", ".3f"),
            row("trainer constructor s", "init_s", ".2f", False),
            row("`_connect` s (roles started)", "connect_s", ".2f", False),
            row("step 1 alone s", "step1_s", ".2f", False),
            row("`run()` to step 1 s", "run_to_step1_s", ".2f", False),
            row("wall s (constructor to end)", "wall_s", ".1f", False)]
    rtt = {k: [x["rtt_ms"].get(k, float("nan")) for x in (ca, cs)] for k in ("worker", "engine", "trainer")}
    out += ["", "A trivial call's round trip from the controller, after the run (median of "
            f"{RTT_CALLS}, async / sync run): " + ", ".join(f"{k} {a:.2f} / {b:.2f} ms" for k, (a, b) in rtt.items()),
            "", f"Weight publication per step (steps 2..{steps}, mean / median ms; state dict "
            f"{ia['state_dict_mb']:.2f} MiB):", "",
            "| run | weight_sync_s | get the state dict | load into the engine(s) | of which `ray.put` |",
            "|---|---:|---:|---:|---:|"]
    for label, a, s in pairs:
        for mode, x in (("async", a), ("sync", s)):
            out.append(f"| {label} {mode} | {_ms(x['weight_sync_s'])} | {_ms(x['get_weights_s'])} | "
                       f"{_ms(x['load_weights_s'])} | {_ms(x['put_s'])} |")
    for mode, x, y in (("async", ia, ca), ("sync", is_, cs)):
        xw, yw = x["weight_sync_s"], y["weight_sync_s"]
        out += ["", f"weight_sync_s cluster / in-process ({mode}): {fmean(yw) / fmean(xw):.1f}x (means), "
                f"{median(yw) / median(xw):.1f}x (medians); share of the step: {fmean(xw) / x['step_s']:.1%} "
                f"in-process, {fmean(yw) / y['step_s']:.1%} cluster."]
    return "\n".join(out)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    result = measure(n)
    (OUT / "cluster_efficiency.json").write_text(json.dumps(result, indent=1))
    print(markdown(result))
