"""The train loop: rollouts feed the data bus, the trainer consumes it, weights flow back.

Two schedules share everything but their loop: `mode: sync` is the colocated
schedule written out plainly (generate a step's groups, train, push weights,
repeat); `mode: async` lets rollouts run ahead of the trainer by at most
`max_staleness` versions through the data bus's admission control. Requests
are seeded per (task, group member, turn) and each step trains on its groups
sorted by task seed, so with `max_staleness: 0` the async run reproduces the
sync run's batches, and its losses, exactly.

A run fails loud and loses nothing: everything it was given is checked before
it starts (`relax_gym.rollout.startup`); a task ledger saves the tasks started
but not yet trained with each checkpoint, and a resumed run issues them first
with the data bus's counters restored, so an interrupted run trains the same
tasks as an uninterrupted one; a run that cannot learn (no trainable sample for
`max_steps_without_samples` steps, every episode failing the same way, an
engine that stays away) stops with `RunStopped` after checkpointing.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from relax_gym.cpu.process import settle_heap
from relax_gym.cpu.threads import release_openmp_workers
from relax_gym.engines.base import EngineError, EngineUnavailableError, RequestError
from relax_gym.engines.factory import make_engine
from relax_gym.env.registration import resolve_env_id
from relax_gym.errors import RunStopped, StartupError
from relax_gym.models import load_model
from relax_gym.models.lora import write_adapter
from relax_gym.models.moe_routing import experts_per_token
from relax_gym.rollout import RolloutManager
from relax_gym.rollout.evaluation import EVAL_SEED_OFFSET
from relax_gym.rollout.manager import ENGINE_UNAVAILABLE
from relax_gym.rollout.metrics import reason_kind, reward_failures, status_breakdown
from relax_gym.rollout.startup import EnvUse, check_run
from relax_gym.trainer.algorithms import filter_uniform_groups, group_advantages, make_loss_fn
from relax_gym.trainer.backends.base import TrainBackend
from relax_gym.trainer.batch import Sample
from relax_gym.trainer.checkpoint import CheckpointManager
from relax_gym.trainer.config import LoraSection, TrainConfig
from relax_gym.trainer.databus import DataBus, Group
from relax_gym.trainer.distributed import DrivingBackend, world
from relax_gym.trainer.policy import load_policy, make_backend
from relax_gym.trainer.run_log import RunLog

_T = TypeVar("_T")

TRAINABLE = ("completed", "truncated")


@dataclass
class TrainedStep:
    """A step the backend has trained that the run has not yet concluded (pushed, logged, checkpointed)."""

    version: int
    groups: list[Group]
    samples: list[Sample]
    metrics: dict[str, float]
    timings: dict[str, float]
    counters: dict[str, Any]
    #: the weights at `version` (`Trainer._snapshot`), or None where the push reads them itself
    weights: Any


@dataclass
class StepJob:
    """An async run's step in flight: the take of its groups from the bus, then its training."""

    step: int
    take: asyncio.Future[list[Group]]
    task: asyncio.Task[TrainedStep]
    take_started: float
    taken_at: float = 0.0


def task_seed(run_seed: int, task: int) -> int:
    """The env seed of a run's training task: below `EVAL_SEED_OFFSET` whatever the run's seed, so a training task
    never shares a seed with a held-out one (which start there)."""
    return (run_seed * 1_000_003 + task) % EVAL_SEED_OFFSET


def task_of_seed(run_seed: int, seed: int) -> int:
    """The task whose `task_seed` is `seed` (tasks are numbered below `EVAL_SEED_OFFSET`)."""
    return (seed - run_seed * 1_000_003) % EVAL_SEED_OFFSET


def group_to_samples(group: Group, std_normalize: bool) -> list[Sample]:
    """GRPO-style samples: advantages relative to the trainable episodes of the same group id (one id for a task's
    episodes; one per seat for a self-play game's, `relax_gym.env.seats`). An episode whose reward could not be
    computed (a judge's `timeout` or `error`) is left out: its 0 is no judgement of the answer."""
    usable = [t for t in group if t.status in TRAINABLE and t.num_generated > 0
              and t.metrics.get("reward_status", "ok") == "ok"]
    if not usable:
        return []
    rewards = torch.tensor([t.reward for t in usable], dtype=torch.float32)
    advantages = group_advantages(rewards, [t.group_id for t in usable], std_normalize=std_normalize)
    return [
        Sample(token_ids=t.token_ids, loss_mask=t.loss_mask, rollout_logprobs=t.rollout_logprobs,
               advantage=float(a), mm_inputs=t.mm_inputs, versions=t.versions, routed_experts=t.routed_experts)
        for t, a in zip(usable, advantages.tolist(), strict=True)
    ]


def make_run_dir(path: Path) -> Path | None:
    """Creates `path` (checking it is writable); returns the topmost folder it created, to remove if the run
    cannot start, or None when `path` was there already."""
    top = next((p for p in [*reversed(path.parents), path] if not p.exists()), None)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        if top is not None and top.is_dir():
            shutil.rmtree(top, ignore_errors=True)
        raise StartupError(f"run_dir {path}: cannot write there ({err.strerror or type(err).__name__})") from None
    return top


class Trainer:
    """A run: builds and checks everything in `__init__` (nothing is left behind if that fails), trains in `run`."""

    #: whether an async run may start its next step while this one trains (`_start_ahead`)
    _ahead_ok = True

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self._told_checkpoint_size = False
        self.run_dir = Path(cfg.run_dir)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep=cfg.trainer.keep_checkpoints)
        if cfg.trainer.resume == "never" and self.checkpoints.steps():
            raise StartupError(f"run_dir {self.run_dir} holds a run (checkpoint step {self.checkpoints.latest_step()})"
                               " and trainer.resume=never: choose another run_dir, or trainer.resume=auto")
        self._created = make_run_dir(self.run_dir)
        try:
            self._build()
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Removes what a run that could not start created."""
        if self._created is not None:
            shutil.rmtree(self._created, ignore_errors=True)

    def _build(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        #: envs[i].id as given may be a file.py or module: the registered ids they name
        self.env_ids = [resolve_env_id(e.id) for e in cfg.envs]
        self.loaded = load_policy(cfg)
        if cfg.algorithm.routing_replay and experts_per_token(self.loaded.model.config) is None:
            raise StartupError(f"algorithm.routing_replay: model {cfg.model.path!r} is not a mixture of experts "
                               "(nothing to replay); drop it or train an MoE model (e.g. tiny-moe)")
        r = cfg.rollout
        check_run(self.loaded, self._env_uses(), max_total_tokens=r.max_total_tokens, max_new_tokens=r.max_new_tokens,
                  seed=self.task_seed(0), concurrency=r.concurrency)
        self.sampling = r.sampling_params()
        #: the thread every backend call runs in, placed by `cpu.trainer` (the engine has its own); with
        #: `trainer.own_process` it only waits on the trainer's process, which takes the placement itself
        self._trainer_thread = ThreadPoolExecutor(
            1, thread_name_prefix="relax-gym-trainer",
            initializer=None if cfg.trainer.own_process else cfg.cpu.trainer.placement().apply)
        self._build_roles()
        self.algo = cfg.algorithm.to_algorithm_config()
        self.loss_fn = make_loss_fn(self.algo)
        self.ref = self._frozen(cfg.model.path) if self.algo.kl_coef > 0 else None
        self.teacher = self._frozen(cfg.algorithm.teacher) if cfg.algorithm.teacher else None
        (self.run_dir / "config.yaml").write_text(_yaml(cfg))
        self.log = RunLog(self.run_dir, total_steps=cfg.trainer.total_steps)
        self._sigint = False
        self._unwatch: Callable[[], object] = lambda: None
        self._start_fresh()
        self.resumed_from: int | None = None
        self.eval_failures = 0
        self._eval_tasks: set[asyncio.Task] = set()

    def _start_fresh(self) -> None:
        """The run's position before its first step (`_resume` then moves it to a checkpoint's)."""
        self.step = 0
        self.next_task = 0
        #: the task ledger: tasks started and not yet trained or discarded, in start order (saved with each
        #: checkpoint), and those a resumed run must start again before any new one
        self.unfinished: dict[int, None] = {}
        self.reissue: deque[int] = deque()
        self.bus: DataBus | None = None
        self._bus_state: dict[str, Any] | None = None
        self.filtered = 0  # sync mode's run total (async keeps it on the bus)
        self.steps_without_samples = 0
        self._backend_failures = 0  # backend jobs that raised (see `_backend_step`)

    def _build_roles(self) -> None:
        """The engine, the training backend and the rollout manager, all in this process (`ClusterTrainer`
        makes them Ray actors instead)."""
        cfg, r = self.cfg, self.cfg.rollout
        self.engine = make_engine(self.loaded, r, seed=cfg.seed, placement=cfg.cpu.engine.placement(),
                                  lora=cfg.trainer.served_adapters())
        self.backend: TrainBackend
        if cfg.trainer.own_process:
            from relax_gym.trainer.backends.process import ProcessBackend

            self.backend = ProcessBackend(cfg, cfg.cpu.trainer.placement())
        else:
            self.backend = make_backend(cfg, self.loaded)
        if world()[1] > 1:  # under torchrun: this is rank 0; the other ranks run `follow`
            self.backend = DrivingBackend(self.backend)
        self.manager = RolloutManager(self.engine, self.loaded, sampling=self.sampling, limits=r.limits(),
                                      max_concurrency=r.concurrency, sampling_seed=cfg.seed,
                                      routed_experts=cfg.algorithm.routing_replay)

    def _env_uses(self) -> list[EnvUse]:
        """Every (id, kwargs) the run will build: each env's training kwargs, and its eval kwargs if evals run."""
        pairs = list(enumerate(zip(self.env_ids, self.cfg.envs, strict=True)))
        uses = [EnvUse(i, e.kwargs, f"envs[{n}]") for n, (i, e) in pairs]
        if self.cfg.trainer.eval_every:
            uses += [EnvUse(i, {**e.kwargs, **e.eval_kwargs}, f"envs[{n}] (eval)") for n, (i, e) in pairs
                     if e.eval_kwargs]
        return uses

    def _frozen(self, model: str) -> TrainBackend:
        from relax_gym.trainer.backends.torch_backend import TorchBackend

        return TorchBackend(load_model(model), seed=self.cfg.seed)

    # --- tasks ------------------------------------------------------------------------
    def env_for(self, task: int) -> tuple[str, dict[str, Any]]:
        n = task % len(self.cfg.envs)
        return self.env_ids[n], self.cfg.envs[n].kwargs

    def task_seed(self, task: int) -> int:
        return task_seed(self.cfg.seed, task)

    def task_of(self, group: Group) -> int:
        """The task a group played (the inverse of `task_seed`)."""
        seed = group[0].seed
        assert seed is not None, "the loop seeds every episode it plays (task_seed)"
        return task_of_seed(self.cfg.seed, int(seed))

    def _start_task(self) -> int:
        """The next task to play: one a resumed run lost in flight, else a new one; it enters the ledger."""
        if self.reissue:
            task = self.reissue.popleft()
        else:
            task = self.next_task
            self.next_task += 1
        self.unfinished[task] = None
        return task

    def _finish_tasks(self, groups: list[Group]) -> None:
        """These groups were trained on or discarded: a resumed run must not play them again."""
        for group in groups:
            self.unfinished.pop(self.task_of(group), None)

    async def run_task(self, task: int) -> Group:
        env_id, kwargs = self.env_for(task)
        return await self.manager.run_group(env_id, self.task_seed(task), self.cfg.rollout.group_size,
                                            env_kwargs=kwargs)

    # --- the loop ---------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Trains to `total_steps`; Ctrl-C (or cancellation) finishes the running step, checkpoints and plots.

        Raises `RunStopped` when the run cannot go on (after checkpointing and
        plotting), `StartupError` when its engine cannot be reached at all.
        """
        await self._connect()
        interrupted = False
        self._watch_sigint()
        try:
            await self._train()
        except (KeyboardInterrupt, asyncio.CancelledError):
            interrupted = True
        finally:
            for job in self._eval_tasks if interrupted else ():
                job.cancel()
            await asyncio.gather(*self._eval_tasks, return_exceptions=True)
            if self.step > self.checkpoints.latest_step():
                self._checkpoint()
            self._unwatch()
            self.log.close(plot=True)
            await self._close_engine()
            self._trainer_thread.shutdown(wait=False)
        summary = self.log.summary()
        summary.update(interrupted=interrupted, resumed_from=self.resumed_from, eval_failures=self.eval_failures)
        return summary

    async def _train(self) -> None:
        """Resumes from the newest checkpoint, if any, and trains to `total_steps`."""
        await self._resume()
        settle_heap()
        release_openmp_workers()  # this thread's, from loading and resuming: it computes nothing from here
        if self.cfg.trainer.eval_every and self.cfg.trainer.eval_at_start and self.step == 0:
            await self._eval_logged(0)  # awaited: its episodes all see the starting weights
        if self.cfg.trainer.mode == "sync":
            await self._run_sync()
        else:
            await self._run_async()

    def _watch_sigint(self) -> None:
        """Ctrl-C (or SIGTERM, a scheduler's or `ray job stop`'s way to say it) cancels the run's task (as
        asyncio.run would) and also marks the run interrupted, so a cancellation lost in a race (Python 3.11's
        wait_for can swallow one) still stops it at the next step; either way the running step finishes, is
        checkpointed and plotted."""
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()

        def interrupt() -> None:
            if self._sigint:  # pressed twice: stop now, as asyncio.run does
                raise KeyboardInterrupt
            self._sigint = True
            if task is not None:
                task.cancel()

        try:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, interrupt)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            return
        self._unwatch = lambda: [loop.remove_signal_handler(s) for s in (signal.SIGINT, signal.SIGTERM)]

    def _going_on(self) -> bool:
        """Whether another step is due; raises KeyboardInterrupt once Ctrl-C was pressed."""
        if self._sigint:
            raise KeyboardInterrupt
        return self.step < self.cfg.trainer.total_steps

    async def _connect(self) -> None:
        """An engine server is waited for and resumed (a killed run may have left it paused) before anything."""
        try:
            await self.engine.connect()
        except EngineError as err:
            self.log.close(plot=False)
            await self._close_engine()
            self._abandon()
            where = self.cfg.rollout.engine_url or self.cfg.rollout.engine_urls or self.cfg.rollout.engine
            raise StartupError(f"rollout.engine_url {where}: {err}") from None

    async def _close_engine(self) -> None:
        await self.manager.close()
        await self.engine.close()
        if isinstance(self.backend, DrivingBackend):
            self.backend.stop()
        close = getattr(self.backend, "close", None)
        if close is not None:  # a backend in a process of its own stops it
            close()

    def _keep(self, group: Group) -> bool:
        if not self.algo.filter_uniform_groups:
            return True
        # a self-play game's seats are groups of their own: keep it while any seat's rewards differ
        ids = [t.group_id for t in group]
        return bool(filter_uniform_groups(torch.tensor([t.reward for t in group]), ids).any())

    def _check_engine(self, group: Group) -> None:
        """An engine that stayed away past its outage timeout ends the run (its tasks stay in the ledger)."""
        for t in group:
            if t.status == "aborted" and t.status_reason.startswith(ENGINE_UNAVAILABLE):
                raise RunStopped(self._engine_gone(t.status_reason))

    def _engine_gone(self, reason: str) -> str:
        """What a run whose engine stayed away says when it stops."""
        return (f"the engine stayed unreachable, so the run stopped at step {self.step} (checkpointed): {reason}. "
                "Restart the server and rerun to resume.")

    async def _run_sync(self) -> None:
        """The colocated schedule: generate one step's groups, train on them, push weights, repeat."""
        while self._going_on():
            t0 = time.perf_counter()
            groups: list[Group] = []
            while len(groups) < self.cfg.rollout.groups_per_step:  # refill what the filter drops
                tasks = [self._start_task() for _ in range(self.cfg.rollout.groups_per_step - len(groups))]
                for group in await asyncio.gather(*(self.run_task(t) for t in tasks)):
                    self._check_engine(group)
                    if self._keep(group):
                        groups.append(group)
                    else:
                        self.filtered += 1
                        self._finish_tasks([group])
            await _finish_step(self._train_on(groups, time.perf_counter() - t0, {"filtered_total": self.filtered}))

    async def _run_async(self) -> None:
        """Rollouts run ahead of training by at most `max_staleness` versions (see DataBus); with
        `max_staleness` of 1 or more each step is started while the one before trains (`_start_ahead`)."""
        bus = DataBus(self.cfg.rollout.groups_per_step, self.cfg.trainer.max_staleness, keep=self._keep,
                      on_discard=lambda group: self._finish_tasks([group]))
        if self._bus_state is not None:
            bus.restore(self._bus_state, self.step, unfinished=len(self.reissue))
        else:
            bus.version = self.step
        self.bus = bus
        producer = asyncio.create_task(self._produce(bus))
        #: the step whose groups are being taken, or the next one, started ahead (`_start_ahead`)
        self._ahead: StepJob | None = None
        self._trained_at = time.perf_counter()  # when the backend last finished a step: rollout waits count from it
        try:
            while self._going_on():
                self._ahead = self._ahead or self._start_step(bus, self.step + 1)
                await asyncio.wait([self._ahead.take])  # its groups are here, or the take failed (the step raises)
                job = self._ahead
                self._ahead = self._start_ahead(bus, job)
                await _finish_step(self._step_async(bus, job))
        except BaseException as err:
            if self._ahead is not None:
                await self._settle_ahead(self._ahead, err)
            raise
        finally:
            await bus.close()
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)

    def _start_step(self, bus: DataBus, step: int) -> StepJob:
        """Step `step`: its groups taken from the bus at the version it trains (`step - 1`), then trained."""
        take = asyncio.ensure_future(bus.take(version=step - 1))

        async def train() -> TrainedStep:
            groups = await take
            job.taken_at = time.perf_counter()
            return await self._train_step(step, groups, self._bus_counters(bus))

        job = StepJob(step, take, asyncio.ensure_future(train()), time.perf_counter())
        return job

    def _start_ahead(self, bus: DataBus, job: StepJob) -> StepJob | None:
        """The step after `job`, started while `job` trains, if the schedule allows it.

        Its groups are taken as they arrive, by the rule of the version they
        will be trained at, and its backend work queues behind `job`'s on
        the trainer's thread: the trainer goes from one update to the next while
        the loop pushes, logs and batches, so with two cores the async step
        approaches max(T_rollout, T_train). Not with `max_staleness: 0` (the next
        step's groups cannot start before this step's weights are pushed: the
        synchronous schedule stays exact), not past a checkpoint (it reads the
        backend) and not in a trainer whose push reads the backend itself
        (`_ahead_ok`).
        """
        if (not self._ahead_ok or self.cfg.trainer.max_staleness == 0 or self._sigint or _failed(job.take)
                or _failed(job.task) or job.step >= self.cfg.trainer.total_steps or self._checkpoint_due(job.step)):
            return None
        return self._start_step(bus, job.step + 1)

    async def _step_async(self, bus: DataBus, job: StepJob) -> None:
        """A step's training awaited and concluded; the rollout wait it logs is the part of its take that the
        trainer sat idle for (none when its groups were there before the step before it was trained)."""
        trained = await job.task
        trained.timings["wait_rollout_s"] = max(0.0, job.taken_at - max(job.take_started, self._trained_at))
        self._trained_at = time.perf_counter()
        await self._conclude(trained)
        await bus.advance(self.step)

    @staticmethod
    def _bus_counters(bus: DataBus) -> dict[str, Any]:
        return {"dropped_stale_total": bus.dropped_stale, "filtered_total": bus.filtered,
                "staleness_histogram": dict(bus.staleness_histogram)}

    async def _settle_ahead(self, ahead: StepJob, err: BaseException) -> None:
        """The step in `_ahead` when the run stops: one still waiting for its groups is dropped (its tasks stay in
        the ledger); one training runs to its end and is logged, weights not pushed, so the checkpoint the run
        leaves holds what its log says. Its failure becomes a note on `err`."""
        if not ahead.take.done():
            ahead.take.cancel()
            await asyncio.gather(ahead.take, ahead.task, return_exceptions=True)
            return
        try:
            trained = await _finish_step(ahead.task)
        except BaseException as lost:
            err.add_note(f"step {ahead.step}, started ahead of step {ahead.step - 1}'s push, failed too: {lost!r}")
            return
        self._account(trained)
        self._log_step(trained)

    async def _produce(self, bus: DataBus) -> None:
        """Starts groups as admission allows; each goes to the bus when done. A group that raises (a bug) or
        finds the engine gone fails the bus, which ends the run with that error: nothing retries it."""
        pending: set[asyncio.Task] = set()

        async def one(task: int) -> None:
            try:
                group = await self.run_task(task)
                self._check_engine(group)
            except Exception as err:
                await bus.fail(err)
                return
            await bus.put(group)

        try:
            while await bus.admit():
                job = asyncio.create_task(one(self._start_task()))
                pending.add(job)
                job.add_done_callback(pending.discard)
        finally:
            for job in pending:
                job.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _train_on(self, groups: list[Group], waited: float, counters: dict[str, Any]) -> None:
        trained = await self._train_step(self.step + 1, groups, counters)
        trained.timings["wait_rollout_s"] = waited
        await self._conclude(trained)

    async def _train_step(self, step: int, groups: list[Group], counters: dict[str, Any]) -> TrainedStep:
        """The backend's part of step `step`, in one job on the trainer's thread (`_backend_step`); the run's
        own state (step, ledger, log) moves in `_conclude`."""
        groups = sorted(groups, key=lambda g: g[0].seed if g and g[0].seed is not None else 0)
        trajs = [t for g in groups for t in g]
        if trajs and all(t.status == "aborted" for t in trajs):
            raise RunStopped(f"every episode of step {step} was aborted, so it was not trained "
                             f"(its tasks are kept for a resume): {status_breakdown(trajs)}")
        counters = {**counters, **self.role_counters()}
        samples = [s for g in groups for s in group_to_samples(g, self.algo.std_normalize)]
        metrics, timings, version, weights = await self._on_trainer_thread(self._backend_step, samples,
                                                                           self._backend_failures)
        return TrainedStep(version, groups, samples, metrics, {"wait_rollout_s": 0.0, **timings}, counters,
                           weights)

    def _backend_step(self, samples: list[Sample], failures_seen: int) -> tuple[dict[str, float], dict[str, float],
                                                                                  int, Any]:
        """On the trainer's thread, everything a step asks of the backends, in order: the logprobs the loss needs,
        the update, and `_snapshot` of the weights it made, before any later job can change them.

        A job queued behind one that failed (a step started ahead) does nothing: `failures_seen` is the count
        of failed jobs when it was queued."""
        if self._backend_failures != failures_seen:
            raise RuntimeError("not trained: the step before it failed")
        try:
            return self._backend_calls(samples)
        except BaseException:
            self._backend_failures += 1
            raise

    def _backend_calls(self, samples: list[Sample]) -> tuple[dict[str, float], dict[str, float], int, Any]:
        temperature = self.cfg.rollout.temperature
        t0 = time.perf_counter()
        for frozen, attr in ((self.ref, "ref_logprobs"), (self.teacher, "teacher_logprobs")):
            if frozen is not None and samples:
                for s, o in zip(samples, frozen.logprobs(samples, temperature=temperature), strict=True):
                    setattr(s, attr, o.logprobs.clone())
        t1 = time.perf_counter()
        metrics: dict[str, float] = {}
        if samples:  # the old logprobs are taken where the weights live, in the update's own call
            metrics = self.backend.train_step(samples, self.loss_fn, temperature=temperature,
                                              recompute_old_logprobs=self.cfg.algorithm.recompute_old_logprobs)
        else:
            self.backend.version += 1  # nothing trainable this step: the policy version still advances
        t2 = time.perf_counter()
        weights = self._snapshot()
        old_s = metrics.pop("old_logprobs_s", 0.0)  # a phase of the step, timed where it ran
        timings = {"logprobs_s": t1 - t0 + old_s, "train_s": t2 - t1 - old_s,
                   "weight_sync_s": time.perf_counter() - t2}
        return metrics, timings, self.backend.version, weights

    @property
    def _pushed_adapter(self) -> LoraSection | None:
        """The adapter whose folder each push sends where the engine loads adapters by name (vLLM, SGLang); None
        where pushes are weights (the embedded engine: the merged adapted layers)."""
        return self.cfg.trainer.lora if self.cfg.rollout.engine in ("vllm", "sglang") else None

    def _snapshot(self) -> Any:
        """The weights `_push_weights` sends, read on the trainer's thread right after the update: the adapter
        where the engine loads adapters, else the weights."""
        return self.backend.adapter_state_dict() if self._pushed_adapter else self.backend.hf_state_dict()

    async def _conclude(self, trained: TrainedStep) -> None:
        """The run moves to a trained step: its weights go to the engine, it is logged, checkpointed, evaluated."""
        cfg = self.cfg
        self._account(trained)
        t0 = time.perf_counter()
        try:
            await self._push_weights(trained.weights)
        finally:  # the step is trained: it is logged even if the push fails, and so before any checkpoint of it
            trained.timings["weight_sync_s"] += time.perf_counter() - t0  # after the snapshot's share
            self._log_step(trained)
        if self._checkpoint_due(self.step):
            self._checkpoint()
        if cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0:
            self._start_eval(self.step)
        self._stop_if_not_learning([t for g in trained.groups for t in g], bool(trained.samples))
        await self._after_step()

    def _account(self, trained: TrainedStep) -> None:
        """The run's position moves to `trained`: its version, and its tasks leave the ledger."""
        self.step = trained.version
        self._finish_tasks(trained.groups)

    def _log_step(self, trained: TrainedStep) -> None:
        self.log.step(trained.version, trained.groups, trained.samples, trained.metrics, trained.timings,
                      trained.counters)

    def _checkpoint_due(self, step: int) -> bool:
        return step % self.cfg.trainer.checkpoint_every == 0 or step == self.cfg.trainer.total_steps

    async def _on_trainer_thread(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """`fn(*args, **kwargs)` in the trainer's own thread (see `cpu.trainer`), awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._trainer_thread,
                                                                functools.partial(_then_idle, fn, *args, **kwargs))

    async def _after_step(self) -> None:
        """Called after each step is logged and checkpointed (`ClusterTrainer` runs its `on_step` hook here)."""

    def role_counters(self) -> dict[str, Any]:
        """Run totals of the roles (failovers, restarts) for each step's metrics: none in one process."""
        return {}

    def _stop_if_not_learning(self, trajs: list[Any], trained: bool) -> None:
        """Every episode failing the same way, or every reward failing to be computed (a judge that times out),
        stops the run at once; no trainable sample for `max_steps_without_samples` steps in a row stops it too."""
        self.steps_without_samples = 0 if trained else self.steps_without_samples + 1
        unscored = reward_failures(trajs)
        if trajs and sum(unscored.values()) == len(trajs):
            detail = next((str((i.get("reward") or {}).get("detail")) for t in trajs for i in t.infos[-1:]), "")
            raise RunStopped(f"no reward of step {self.step} could be computed ({unscored}: a judge or grader that "
                             f"times out or fails scores nothing), so nothing can be learnt; e.g. {detail[:300]}")
        if trained or not trajs:
            return
        kinds = {reason_kind(t.status_reason) for t in trajs}
        if all(t.status == "failed" for t in trajs) and len(kinds) == 1:
            raise RunStopped(f"every episode of step {self.step} failed the same way, so nothing can be learnt: "
                             f"{status_breakdown(trajs)}")
        limit = self.cfg.trainer.max_steps_without_samples
        if self.steps_without_samples >= limit:
            raise RunStopped(f"no trainable sample for {limit} steps in a row (trainer.max_steps_without_samples), "
                             f"so the run cannot learn; the last step's {status_breakdown(trajs)}")

    async def _push_weights(self, weights: Any = None) -> None:
        """The trained weights (`_snapshot`'s, or the backend's now if None) to the engine, between its turns; an
        engine that stays away stops the run."""
        if weights is None:
            weights = await self._on_trainer_thread(self._snapshot)
        try:
            await self.engine.pause()
            try:
                if (lora := self._pushed_adapter) is not None:  # the adapter alone: a PEFT folder loaded by name
                    folder = write_adapter(self.run_dir / "weights" / f"v{self.step}", weights, lora.spec(),
                                           self.loaded.model, self.loaded.name)
                    await self.engine.update_weights(str(folder), self.step)
                    _prune_weight_folders(folder)
                elif self.cfg.rollout.engine in ("sglang", "vllm") and not self.cfg.rollout.weights_as_tensors():
                    folder = self.run_dir / "weights" / f"v{self.step}"
                    # an adapter's push names its merged layers only: the rest of the folder is the base's
                    self.loaded.model.load_state_dict(weights, strict=self.cfg.trainer.lora is None)
                    self.loaded.model.save_pretrained(folder)
                    await self.engine.update_weights(str(folder), self.step)
                    _prune_weight_folders(folder)
                else:
                    await self.engine.update_weights(weights, self.step)
            except (EngineUnavailableError, asyncio.CancelledError):
                raise  # resuming a server that is gone waits out its outage again; a paused one is resumed at start
            except BaseException:
                await self.engine.resume()
                raise
            await self.engine.resume()
        except EngineError as err:
            raise RunStopped(f"pushing the weights of step {self.step} to the engine failed, so the run stopped "
                             f"(checkpointed): {err}. Restart the server and rerun to resume.") from err

    # --- evaluation -------------------------------------------------------------------
    def _start_eval(self, version: int) -> None:
        job = asyncio.create_task(self._eval_logged(version))
        self._eval_tasks.add(job)
        job.add_done_callback(self._eval_tasks.discard)

    async def _eval_logged(self, version: int) -> None:
        """An eval that raises is logged as such and counted; it does not stop training."""
        try:
            await self.evaluate(version)
        except Exception as err:
            self.eval_failures += 1
            self.log.eval_error(version, f"{type(err).__name__}: {err}")

    async def evaluate(self, version: int) -> dict[str, float]:
        """Episodes on held-out tasks (eval kwargs, seeds disjoint from training's), greedy unless
        `trainer.eval_temperature` says otherwise."""
        cfg = self.cfg
        sampling = replace(self.sampling, temperature=cfg.trainer.eval_temperature)
        manager = RolloutManager(self.engine, self.loaded, sampling=sampling, limits=self.manager.limits,
                                 max_concurrency=cfg.rollout.concurrency,
                                 sampling_seed=EVAL_SEED_OFFSET)  # a sampled eval draws as `relax-gym eval` does
        results: dict[str, list[Any]] = {}
        try:
            for env_id, env in zip(self.env_ids, cfg.envs, strict=True):
                kwargs = {**env.kwargs, **env.eval_kwargs}
                results[env_id] = await manager.run(env_id, cfg.trainer.eval_tasks, cfg.trainer.eval_samples,
                                                    seed=EVAL_SEED_OFFSET, env_kwargs=kwargs)
        finally:
            await manager.close()
        return self.log.eval(version, results)

    # --- checkpoints ------------------------------------------------------------------
    def _checkpoint(self) -> None:
        folder = self.checkpoints.save(self.backend, self.step, {
            "step": self.step, "next_task": self.next_task, "unfinished": list(self.unfinished),
            "bus": self.bus.state() if self.bus is not None else None, "filtered_total": self.filtered,
        })
        if not self._told_checkpoint_size:
            self._told_checkpoint_size = True
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            keep = self.cfg.trainer.keep_checkpoints
            self.log.note(f"checkpoint {folder.name}: {_size(size)} (weights and optimizer state); the newest "
                          f"{keep} are kept, up to {_size(keep * size)} (trainer.keep_checkpoints)")

    async def _resume(self) -> None:
        """Continues from the newest good checkpoint, if any: weights, optimizer, RNG, the task ledger, the data
        bus's counters, metrics; says so."""
        found = self.checkpoints.load_latest(self.backend)
        if found is None:
            if logged := len(self.log.records()):  # a killed run that never checkpointed: it starts afresh
                self.log.truncate_after(0)
                self.log.note(f"{self.run_dir} holds {logged} logged steps but no checkpoint: starting afresh "
                              "(those rows are dropped)")
            return
        step, extra = found
        self.step = self.resumed_from = step
        self.next_task = int(extra["next_task"])
        self.reissue = deque(int(t) for t in extra.get("unfinished", ()))
        self._bus_state = extra.get("bus")
        self.filtered = int(extra.get("filtered_total", 0))
        self.log.truncate_after(step)
        self.log.note(f"resuming {self.run_dir} from step {step} ({self.checkpoints.folder(step)}); "
                      f"{len(self.reissue)} unfinished tasks are played first")
        try:
            await self._push_weights()  # the engine was built from the initial weights
        except RequestError as err:  # e.g. a server still holding newer weights from before the crash
            raise StartupError(f"rollout.engine_url {self.cfg.rollout.engine_url}: the checkpoint's weights (step "
                               f"{step}) were refused: {err}; restart the engine server") from None


async def _finish_step(step: Awaitable[_T]) -> _T:
    """Runs a training step to its end even if the run is interrupted meanwhile (its update runs in a
    thread, and a checkpoint taken halfway through would not match the logged step); returns its result."""
    job = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await job
        raise


def _prune_weight_folders(current: Path) -> None:
    """Removes the `weights/v*` folders beside `current`, which the engine has loaded: it reads a folder only
    during its update, and a folder a step (an 8B model in bf16 is ~16 GB) would fill the disk."""
    for folder in current.parent.glob("v*"):
        if folder != current:
            shutil.rmtree(folder, ignore_errors=True)


def _then_idle(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """`fn(*args, **kwargs)`, then the calling thread's OpenMP workers released: between the trainer's calls the
    engine may compute alone, and idle workers would slow it (`cpu_threads`)."""
    try:
        return fn(*args, **kwargs)
    finally:
        release_openmp_workers()


def _failed(job: asyncio.Future[Any]) -> bool:
    """Whether a job has raised or was cancelled (False while it runs)."""
    return job.done() and (job.cancelled() or job.exception() is not None)


def _yaml(cfg: TrainConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def _size(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
