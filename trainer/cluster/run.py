"""`ClusterTrainer`: the train loop with its roles as Ray actors (the config's `cluster:` section).

The loop, the data bus, the task ledger, checkpoints and the run log are the in-process `Trainer`'s, unchanged:
this process is the controller. What changes is the transport of each role: engines are `EngineService`
actors behind an `ActorFleet`, groups are played by `RolloutWorker` actors through a `WorkerPool`, and the
backend is trainer rank 0's actor behind a `RemoteBackend`. So with `max_staleness: 0` a cluster run trains on
the same batches, and reaches the same losses, as the in-process run (the parity test ties the two).

Recovery: engines and workers are replaced by the `HealthMonitor` while training goes on; a lost trainer rank
restarts the loop from the last checkpoint (the same path as a resumed run: weights, optimizer, task ledger,
data-bus counters, metrics truncated after it, weights republished before any new group is admitted), within
`max_trainer_restarts`; past it, or on an error that is not a lost process, the run stops with the report.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from relax_gym.engines.base import Engine
from relax_gym.errors import RunStopped, StartupError
from relax_gym.rollout.evaluation import EVAL_SEED_OFFSET
from relax_gym.trainer.cluster.config import ClusterSection
from relax_gym.trainer.cluster.control_api import ControlServer, create_control_app, resolve_control_token
from relax_gym.trainer.cluster.fleet import ActorFleet
from relax_gym.trainer.cluster.health import HealthMonitor
from relax_gym.trainer.cluster.placement import in_group, nodes_of, release, reserve, settled, trainer_bundles
from relax_gym.trainer.cluster.preflight import unseen_paths
from relax_gym.trainer.cluster.ray_handles import ACTOR_GONE, RemoteBackend, TrainerLost, WeightsLost, call
from relax_gym.trainer.cluster.roles import TrainerRank, pushed_adapters
from relax_gym.trainer.cluster.scale import ScaleManager
from relax_gym.trainer.cluster.workers import WorkerPool
from relax_gym.trainer.config import TrainConfig
from relax_gym.trainer.databus import Group
from relax_gym.trainer.loop import Trainer

START_TIMEOUT_S = 300.0


@dataclass
class Faults:
    """Deterministic failures to inject (tests and `benchmarks/chaos.py`), each into a role's first incarnation:
    `engines` / `workers` by id (see `EngineService` and `WorkerPool`), `trainer` into the first
    `trainer_times` trainer ranks (see `TrainerRank`)."""

    engines: dict[str, dict[str, int]] = field(default_factory=dict)
    workers: dict[str, dict[str, int]] = field(default_factory=dict)
    trainer: dict[str, int] | None = None
    trainer_times: int = 1


def start_ray(c: ClusterSection) -> None:
    """Joins `c.address`, or starts a local cluster of `c.num_cpus` logical CPUs (default max(8, this machine's))."""
    num_cpus = None if c.address else (c.num_cpus or max(8, os.cpu_count() or 1))
    ray.init(address=c.address, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


class ClusterTrainer(Trainer):
    """A run whose engines, rollout workers and trainer rank are Ray actors; this process is the controller.

    `on_step(self)` (tests, the chaos benchmark) is awaited after each logged step: a place to kill roles.
    """

    #: the trainer rank publishes whatever weights it holds, so no step may train while the last one publishes
    _ahead_ok = False

    def __init__(self, cfg: TrainConfig, *, faults: Faults | None = None,
                 on_step: Callable[[ClusterTrainer], Awaitable[None]] | None = None):
        if cfg.cluster is None:
            raise ValueError("ClusterTrainer needs the config's cluster section")
        self.cluster = cfg.cluster
        self.faults = faults or Faults()
        self.on_step = on_step
        super().__init__(cfg)

    def _build_roles(self) -> None:
        """Nothing starts here: the actors are created in `_connect`, inside the run."""
        self.trainer_restarts = 0
        self._owns_ray = False
        self._trainer_actor: Any = None  # rank 0
        self._trainer_ranks: list[Any] = []
        self._trainer_group: Any = None
        self._monitor_task: asyncio.Task | None = None
        self._trainer_watch: asyncio.Task | None = None
        self.control: ControlServer | None = None

    # --- roles ------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> None:
        """A role's failure or recovery, at the current step (before a resume: the step it resumes from)."""
        self.log.event(self.step or self.checkpoints.latest_step(), kind, **fields)

    def _engines_view(self) -> tuple[int, dict[str, Engine]]:
        return self.fleet.epoch, self.fleet.active()

    async def _connect(self) -> None:
        """Starts (or joins) the Ray cluster, then the trainer rank, the engines (synced to its initial weights
        before they serve) and the rollout workers; anything that cannot start stops the run here."""
        t0 = time.perf_counter()
        try:
            self._start_ray()
            self.fleet = ActorFleet(self.cfg, on_change=self._engines_changed, event=self.event,
                                    status=self.status, faults=self.faults.engines, api_key=secrets.token_urlsafe(24),
                                    distribute=self._distribute if self.cluster.weight_sync == "distributed" else None)
            self.workers = WorkerPool(self.cfg, engines=self._engines_view, event=self.event,
                                      faults=self.faults.workers)
            if self.cluster.address and (unseen := await unseen_paths(self.cfg)):  # a joined cluster's other nodes
                raise StartupError("cluster: " + "; ".join(unseen))
            async with asyncio.TaskGroup() as starting:  # each role loads the model in its own process: at once
                starting.create_task(self._start_trainer())
                starting.create_task(self.fleet.start(self.cluster.engines.count))
                starting.create_task(self.workers.start(self.cluster.rollout_workers.count))
            await self._publish()  # the trainer's initial weights, before any group is admitted
            if self.cluster.control.enabled:
                await self._start_control()
        except BaseException as raised:
            err = raised.exceptions[0] if isinstance(raised, BaseExceptionGroup) else raised  # the first role's
            await self._close_engine()
            self.log.close(plot=False)
            self._abandon()
            if isinstance(err, Exception) and not isinstance(err, StartupError | RunStopped):
                raise StartupError(f"cluster: the roles could not start: {type(err).__name__}: {err}") from None
            raise err from None
        self.monitor = HealthMonitor(self.fleet, self.workers, self.cluster.health,
                                     episode_timeout_s=self.cfg.rollout.episode_timeout_s, event=self.event)
        self._monitor_task = asyncio.create_task(self.monitor.run())
        self.log.note(f"cluster: {_count(len(self.fleet.slots), 'engine')}, "
                      f"{_count(len(self.workers.slots), 'rollout worker')} and "
                      f"{_count(len(self._trainer_ranks), 'trainer rank')} started in {time.perf_counter() - t0:.1f} s")

    async def _start_control(self) -> None:
        """The elastic-rollout control API, in this loop (where the fleet lives), behind a bearer token."""
        c = self.cluster.control
        self.scaler = ScaleManager(self.fleet, max_engines=c.max_engines)
        token = resolve_control_token(self.run_dir, c.token)
        self.control = ControlServer(create_control_app(self.fleet, self.scaler, token), host=c.host, port=c.port,
                                     run_dir=self.run_dir)
        url = await self.control.start()
        self.log.note(f"cluster: control API at {url} (relax-gym cluster status --run-dir {self.run_dir})")

    def _start_ray(self) -> None:
        if not ray.is_initialized():
            start_ray(self.cluster)
            self._owns_ray = True

    async def _engines_changed(self, epoch: int, members: dict[str, Engine]) -> None:
        if hasattr(self, "workers"):
            await self.workers.set_engines(epoch, members)

    async def _start_trainer(self) -> None:
        """The trainer's ranks in their placement group (reserved once: restarted ranks land on the same nodes
        and GPUs), set up together; rank 0 is the loop's backend, the others follow it."""
        fault = None
        if self.faults.trainer and self.faults.trainer_times > 0:
            fault = self.faults.trainer
            self.faults.trainer_times -= 1
        t = self.cluster.trainer
        if self._trainer_group is None:
            self._trainer_group = await reserve(trainer_bundles(self.cluster), "PACK",
                                                START_TIMEOUT_S, "the trainer ranks")
        ranks: list[Any] = []
        for rank in range(t.world_size):
            # rank 0 takes one call at a time, as the loop makes them; a follower answers `ready` while following
            options: dict[str, Any] = {"num_cpus": t.num_cpus, "num_gpus": t.num_gpus, "resources": t.resources,
                                       "max_restarts": 0, "max_task_retries": 0,
                                       "max_concurrency": 1 if rank == 0 else 2,
                                       **in_group(self._trainer_group, rank)}
            ranks.append(ray.remote(TrainerRank).options(**options).remote(self.cfg, fault if rank == 0 else None))
        self._trainer_ranks = ranks
        self._trainer_actor = ranks[0]
        master = await call(ranks[0].address) if t.world_size > 1 else None
        async def set_up() -> list[dict[str, Any]]:  # awaited here, so a cancelled start leaves no stray future
            return list(await asyncio.gather(*(call(r.setup, i, t.world_size, master) for i, r in enumerate(ranks))))

        try:
            infos = await asyncio.wait_for(set_up(), START_TIMEOUT_S)
        except TimeoutError:
            raise StartupError(f"cluster: the {t.world_size} trainer ranks were not set up within "
                               f"{START_TIMEOUT_S:g} s (a rank waiting for the others? see Ray's logs)") from None
        followers = [r.follow.remote() for r in ranks[1:]]
        self.remote = RemoteBackend(self._trainer_actor, version=int(infos[0]["version"]), followers=followers,
                                    stall_s=self.cluster.health.trainer_stall_s)
        self.backend = self.remote
        self._trainer_watch = asyncio.create_task(self._watch_trainer(ranks))

    async def _watch_trainer(self, ranks: list[Any]) -> None:
        """Fails the data bus with TrainerLost once a rank is gone. The loop finds a lost rank when it next calls
        it, but while it waits for groups it makes no call: and when the engines went down with the rank's node,
        their replacements wait for weights only a restarted trainer publishes (the last ones were lost with it),
        so no group would come until `health.engine_wait_s` aborted every episode. A ping queues behind the rank's
        running call and fails as soon as Ray has declared it dead."""
        while True:
            try:
                await asyncio.gather(*(call(rank.ready) for rank in ranks))
            except ACTOR_GONE as err:
                if self.bus is not None:
                    await self.bus.fail(TrainerLost(f"a trainer rank's process is gone ({type(err).__name__})"))
                return
            await asyncio.sleep(self.cluster.health.poll_s)

    def _kill_trainer(self) -> None:
        if self._trainer_watch is not None:  # first: ranks we end are not lost
            self._trainer_watch.cancel()
            self._trainer_watch = None
        for rank in self._trainer_ranks:
            ray.kill(rank)
        self._trainer_ranks = []
        self._trainer_actor = None

    async def _publish(self) -> None:
        """The trainer rank's weights at its version to every ACTIVE engine, as `cluster.weight_sync` says."""
        version = self.backend.version
        weights: ray.ObjectRef | Path | None = None  # distributed: the trainer rank sends its own
        adapter = pushed_adapters(self.cfg) is not None  # the adapter alone, which the servers load by name
        if self.cluster.weight_sync == "disk":
            weights = self.run_dir / "weights" / f"v{version}"
            save = self._trainer_actor.save_adapter if adapter else self._trainer_actor.save_weights
            try:
                await call(save, str(weights))
            except ACTOR_GONE as err:
                raise TrainerLost(f"the trainer rank's process is gone ({type(err).__name__})") from None
        elif self.cluster.weight_sync == "object_store":
            weights = await asyncio.to_thread(self.remote.hf_state_dict_ref)
        try:
            await self.fleet.publish(weights, version)
        except WeightsLost as err:
            raise TrainerLost(str(err)) from None
        if adapter:  # the workers' clients of those servers name it from now on
            await self.workers.adopt_adapter(str(weights), version)

    async def _distribute(self, servers: list[Engine], alone: bool) -> int:
        """The trainer rank broadcasts its weights to these engine servers (`weight_sync: distributed`): gloo on
        CPU, NCCL when the trainer has GPUs."""
        backend = "nccl" if self.cluster.trainer.num_gpus else "gloo"
        master = ray.util.get_node_ip_address() if self.cluster.address else "127.0.0.1"
        try:
            return int(await call(self._trainer_actor.publish_distributed, servers,
                                  master_address=master, backend=backend,
                                  timeout_s=self.cluster.weight_sync_timeout_s, alone=alone))
        except ACTOR_GONE as err:
            raise TrainerLost(f"the trainer rank's process is gone ({type(err).__name__})") from None

    def _snapshot(self) -> None:
        """Nothing: `_publish` has the trainer rank send its own weights."""

    async def _push_weights(self, weights: Any = None) -> None:
        """Trained weights to every ACTIVE engine; engines that fail it are replaced by the health manager and
        sync to these weights before they serve again."""
        await self._publish()

    async def run_task(self, task: int) -> Group:
        env_id, kwargs = self.env_for(task)
        return await self.workers.run_group(env_id, self.task_seed(task), self.cfg.rollout.group_size, kwargs)

    async def evaluate(self, version: int) -> dict[str, float]:
        cfg = self.cfg
        results = {}
        for env_id, env in zip(self.env_ids, cfg.envs, strict=True):
            kwargs = {**env.kwargs, **env.eval_kwargs}
            results[env_id] = await self.workers.run_eval(env_id, cfg.trainer.eval_tasks, EVAL_SEED_OFFSET, kwargs)
        return self.log.eval(version, results)

    def status(self) -> dict[str, Any]:
        """The run as the control API's /v1/status reports it."""
        bus = self.bus.state() if self.bus is not None else {}
        return {"step": self.step, "trainer_version": self.step, "total_steps": self.cfg.trainer.total_steps,
                "bus": {**bus, "staleness_histogram": {str(k): v for k, v in bus.get("staleness_histogram",
                                                                                      {}).items()}},
                "trainer_restarts": self.trainer_restarts}

    def role_counters(self) -> dict[str, Any]:
        routers = [s.stats.get("failovers", 0) for s in self.workers.slots.values()]
        return {"cluster/published_version": self.fleet.published_version,
                "cluster/engines_active": len(self.fleet.active()),
                "cluster/engine_failovers": sum(routers) + self.workers.failovers_of_lost,
                "cluster/lost_worker_calls": self.workers.lost_calls,
                "cluster/probe_failures": self.monitor.probe_failures,
                "cluster/engine_restarts": sum(s.restarts.total for s in self.fleet.slots.values()),
                "cluster/worker_restarts": sum(s.restarts.total for s in self.workers.slots.values()),
                "cluster/trainer_restarts": self.trainer_restarts}

    def _engine_gone(self, reason: str) -> str:
        """An episode found no live engine for `engine_wait_s`."""
        return (f"no engine was live for cluster.health.engine_wait_s={self.cluster.health.engine_wait_s:g} s, so "
                f"the run stopped at step {self.step} (checkpointed): {reason}. The engines' failures are in "
                f"{self.run_dir / 'events.jsonl'}; rerun to resume.")

    async def _after_step(self) -> None:
        if self.on_step is not None:
            await self.on_step(self)

    # --- trainer restarts -------------------------------------------------------------
    async def _train(self) -> None:
        """The loop; a lost trainer rank restarts it from the last checkpoint, `max_trainer_restarts` times."""
        while True:
            try:
                await super()._train()
                return
            except TrainerLost as err:
                await self._restart_trainer(str(err))

    async def _restart_trainer(self, reason: str) -> None:
        """New ranks from the last checkpoint, once Ray has settled the nodes of their reservation; ranks lost
        while they start (their node went down too) are one more restart each, within the same budget."""
        budget = self.cluster.health.max_trainer_restarts
        lost_at = self.step
        started = time.perf_counter()
        while True:
            if self.trainer_restarts >= budget:
                self._kill_trainer()
                raise RunStopped(f"the trainer rank was lost at step {lost_at} ({reason}) after "
                                 f"{self.trainer_restarts} restarts (cluster.health.max_trainer_restarts={budget}); "
                                 f"the run stopped at its last checkpoint (step {self.checkpoints.latest_step()}): "
                                 "rerun to resume")
            self.trainer_restarts += 1
            self._kill_trainer()
            self._start_fresh()  # everything after the last checkpoint is forgotten, as a resumed run forgets it
            await settled(nodes_of(self._trainer_group))
            try:
                await self._start_trainer()
                if not self.checkpoints.latest_step():  # no checkpoint: the engines go back to the initial weights
                    await self._publish()
                break
            except (TrainerLost, *ACTOR_GONE) as err:
                self.log.event(self.checkpoints.latest_step(), "trainer_restart_failed", restarts=self.trainer_restarts,
                               reason=f"a restarted rank was lost as it started ({type(err).__name__})")
        resume_step = self.checkpoints.latest_step()
        self.log.event(resume_step, "trainer_restarted", reason=reason, lost_at_step=lost_at,
                       resumes_from_step=resume_step, restarts=self.trainer_restarts,
                       time_to_recover_s=round(time.perf_counter() - started, 3))

    def _checkpoint(self) -> None:
        if self._trainer_actor is not None:  # a lost trainer's state is gone; its last checkpoint stands
            super()._checkpoint()

    # --- shutting down ----------------------------------------------------------------
    async def _close_engine(self) -> None:
        if self.control is not None:
            await self.control.stop()
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            await asyncio.gather(self._monitor_task, return_exceptions=True)
            await self.monitor.close()
        for role in ("workers", "fleet"):
            if hasattr(self, role):
                await getattr(self, role).shutdown()
        self._kill_trainer()
        release(self._trainer_group)
        if self._owns_ray:
            ray.shutdown()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
