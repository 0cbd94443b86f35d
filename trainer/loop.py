"""The train loop: rollouts feed the data bus, the trainer consumes it, weights flow back.

Two schedules share everything but their loop: `mode: sync` is the colocated
schedule written out plainly (generate a step's groups, train, push weights,
repeat); `mode: async` lets rollouts run ahead of the trainer by at most
`max_staleness` versions through the data bus's admission control. Requests
are seeded per (task, group member, turn) and each step trains on its groups
sorted by task seed, so with `max_staleness: 0` the async run reproduces the
sync run's batches, and its losses, exactly.
"""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from relax_gym.engines.base import SamplingParams
from relax_gym.models import LoadedModel, load_model
from relax_gym.rollout import RolloutLimits, RolloutManager, settle_heap
from relax_gym.rollout.run import make_engine
from relax_gym.trainer.algorithms import filter_uniform_groups, group_advantages, make_loss_fn
from relax_gym.trainer.backends.base import Sample, TrainBackend
from relax_gym.trainer.checkpoint import CheckpointManager
from relax_gym.trainer.config import TrainConfig
from relax_gym.trainer.databus import DataBus, Group
from relax_gym.trainer.distributed import DrivingBackend, follow, world
from relax_gym.trainer.run_log import RunLog

EVAL_SEED_OFFSET = 1_000_000_000  # held-out tasks never share a seed with training tasks
TRAINABLE = ("completed", "truncated")


def make_backend(cfg: TrainConfig, loaded: LoadedModel) -> TrainBackend:
    t = cfg.trainer
    if t.backend == "megatron":
        from relax_gym.trainer.backends.megatron import MegatronBackend

        return MegatronBackend(copy.deepcopy(loaded), tp=t.megatron.tp, pp=t.megatron.pp, lr=t.lr,
                               weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                               micro_batch_tokens=t.micro_batch_tokens, seed=cfg.seed)
    from relax_gym.trainer.backends.torch_backend import TorchBackend

    return TorchBackend(copy.deepcopy(loaded), lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                        micro_batch_tokens=t.micro_batch_tokens, seed=cfg.seed)


def group_to_samples(group: Group, std_normalize: bool) -> list[Sample]:
    """GRPO-style samples: advantages relative to the group's trainable episodes."""
    usable = [t for t in group if t.status in TRAINABLE and t.num_generated > 0]
    if not usable:
        return []
    rewards = torch.tensor([t.reward for t in usable], dtype=torch.float32)
    advantages = group_advantages(rewards, [0] * len(usable), std_normalize=std_normalize)
    return [
        Sample(token_ids=t.token_ids, loss_mask=t.loss_mask, rollout_logprobs=t.rollout_logprobs,
               advantage=float(a), mm_inputs=t.mm_inputs, versions=t.versions)
        for t, a in zip(usable, advantages.tolist(), strict=True)
    ]


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(_yaml(cfg))
        torch.manual_seed(cfg.seed)
        self.loaded = load_model(cfg.model)
        self.engine = make_engine(self.loaded, cfg.rollout.engine_url if cfg.rollout.engine == "sglang" else None,
                                  max_batch_size=cfg.rollout.engine_max_batch_size, seed=cfg.seed)
        self.backend = make_backend(cfg, self.loaded)
        if world()[1] > 1:  # under torchrun: this is rank 0; the other ranks run `follow`
            self.backend = DrivingBackend(self.backend)
        r = cfg.rollout
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                       max_new_tokens=r.max_new_tokens)
        self.manager = RolloutManager(
            self.engine, self.loaded, sampling=self.sampling,
            limits=RolloutLimits(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens,
                                 episode_timeout_s=r.episode_timeout_s),
            max_concurrency=r.concurrency, sampling_seed=cfg.seed,
        )
        self.algo = cfg.algorithm.to_algorithm_config()
        self.loss_fn = make_loss_fn(self.algo)
        self.ref = self._frozen(cfg.model) if self.algo.kl_coef > 0 else None
        self.teacher = self._frozen(cfg.algorithm.teacher) if cfg.algorithm.teacher else None
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints")
        self.log = RunLog(self.run_dir, total_steps=cfg.trainer.total_steps)
        self.step = 0
        self.next_task = 0
        self._eval_tasks: set[asyncio.Task] = set()

    def _frozen(self, model: str) -> TrainBackend:
        from relax_gym.trainer.backends.torch_backend import TorchBackend

        return TorchBackend(load_model(model), seed=self.cfg.seed)

    # --- tasks ------------------------------------------------------------------------
    def env_for(self, task: int) -> tuple[str, dict[str, Any]]:
        env = self.cfg.envs[task % len(self.cfg.envs)]
        return env.id, env.kwargs

    def task_seed(self, task: int) -> int:
        return self.cfg.seed * 1_000_003 + task

    async def run_task(self, task: int) -> Group:
        env_id, kwargs = self.env_for(task)
        return await self.manager.run_group(env_id, self.task_seed(task), self.cfg.rollout.group_size,
                                            env_kwargs=kwargs)

    # --- the loop ---------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Trains to `total_steps`; Ctrl-C (or cancellation) finishes the running step, checkpoints and plots."""
        await self._resume()
        settle_heap()
        interrupted = False
        try:
            if self.cfg.trainer.mode == "sync":
                await self._run_sync()
            else:
                await self._run_async()
        except (KeyboardInterrupt, asyncio.CancelledError):
            interrupted = True
        finally:
            for job in self._eval_tasks if interrupted else ():
                job.cancel()
            await asyncio.gather(*self._eval_tasks, return_exceptions=True)
            if self.step > self.checkpoints.latest_step():
                self._checkpoint()
            self.log.close(plot=True)
            await self.manager.close()
            await self.engine.close()
            if isinstance(self.backend, DrivingBackend):
                self.backend.stop()
        summary = self.log.summary()
        summary["interrupted"] = interrupted
        return summary

    def _keep(self, group: Group) -> bool:
        if not self.algo.filter_uniform_groups:
            return True
        return bool(filter_uniform_groups(torch.tensor([t.reward for t in group]), [0] * len(group)).all())

    async def _run_sync(self) -> None:
        """The colocated schedule: generate one step's groups, train on them, push weights, repeat."""
        filtered = 0
        while self.step < self.cfg.trainer.total_steps:
            t0 = time.perf_counter()
            groups: list[Group] = []
            while len(groups) < self.cfg.rollout.groups_per_step:  # refill what the filter drops
                tasks = range(self.next_task, self.next_task + self.cfg.rollout.groups_per_step - len(groups))
                self.next_task = tasks.stop
                for group in await asyncio.gather(*(self.run_task(t) for t in tasks)):
                    if self._keep(group):
                        groups.append(group)
                    else:
                        filtered += 1
            await _finish_step(self._train_on(groups, time.perf_counter() - t0, {"filtered_total": filtered}))

    async def _run_async(self) -> None:
        """Rollouts run ahead of training by at most `max_staleness` versions (see DataBus)."""
        bus = DataBus(self.cfg.rollout.groups_per_step, self.cfg.trainer.max_staleness, keep=self._keep)
        bus.version = self.step
        producer = asyncio.create_task(self._produce(bus))
        try:
            while self.step < self.cfg.trainer.total_steps:
                t0 = time.perf_counter()
                groups = await bus.take()
                counters = {"dropped_stale_total": bus.dropped_stale, "filtered_total": bus.filtered,
                            "staleness_histogram": dict(bus.staleness_histogram)}
                await _finish_step(self._train_on(groups, time.perf_counter() - t0, counters))
                await bus.advance(self.step)
        finally:
            await bus.close()
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)

    async def _produce(self, bus: DataBus) -> None:
        """Starts groups as admission allows; each goes to the bus when done."""
        pending: set[asyncio.Task] = set()

        async def one(task: int) -> None:
            try:
                group = await self.run_task(task)
            except Exception:
                await bus.cancel_started()
                raise
            await bus.put(group)

        try:
            while await bus.admit():
                task = self.next_task
                self.next_task += 1
                job = asyncio.create_task(one(task))
                pending.add(job)
                job.add_done_callback(pending.discard)
        finally:
            for job in pending:
                job.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _train_on(self, groups: list[Group], waited: float, counters: dict[str, Any]) -> None:
        cfg = self.cfg
        groups = sorted(groups, key=lambda g: g[0].seed if g and g[0].seed is not None else 0)
        samples = [s for g in groups for s in group_to_samples(g, self.algo.std_normalize)]
        timings = {"wait_rollout_s": waited}
        t0 = time.perf_counter()
        temperature = cfg.rollout.temperature
        if samples and cfg.algorithm.recompute_old_logprobs:
            outs = await asyncio.to_thread(self.backend.logprobs, samples, temperature=temperature)
            for s, o in zip(samples, outs, strict=True):
                s.old_logprobs = o.logprobs.tolist()
        for frozen, attr in ((self.ref, "ref_logprobs"), (self.teacher, "teacher_logprobs")):
            if frozen is not None and samples:
                outs = await asyncio.to_thread(frozen.logprobs, samples, temperature=temperature)
                for s, o in zip(samples, outs, strict=True):
                    setattr(s, attr, o.logprobs.tolist())
        timings["logprobs_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        train_metrics: dict[str, float] = {}
        if samples:
            train_metrics = await asyncio.to_thread(self.backend.train_step, samples, self.loss_fn,
                                                    temperature=temperature)
        else:
            self.backend.version += 1  # nothing trainable this step: the policy version still advances
        timings["train_s"] = time.perf_counter() - t0
        self.step = self.backend.version
        t0 = time.perf_counter()
        await self._push_weights()
        timings["weight_sync_s"] = time.perf_counter() - t0
        self.log.step(self.step, groups, samples, train_metrics, timings, counters)
        if self.step % cfg.trainer.checkpoint_every == 0 or self.step == cfg.trainer.total_steps:
            self._checkpoint()
        if cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0:
            self._start_eval(self.step)

    async def _push_weights(self) -> None:
        await self.engine.pause()
        try:
            if self.cfg.rollout.engine == "sglang":
                folder = self.run_dir / "weights" / f"v{self.step}"
                self.loaded.model.load_state_dict(self.backend.hf_state_dict())
                self.loaded.model.save_pretrained(folder)
                await self.engine.update_weights(str(folder), self.step)
            else:
                await self.engine.update_weights(self.backend.hf_state_dict(), self.step)
        finally:
            await self.engine.resume()

    # --- evaluation -------------------------------------------------------------------
    def _start_eval(self, version: int) -> None:
        job = asyncio.create_task(self.evaluate(version))
        self._eval_tasks.add(job)
        job.add_done_callback(self._eval_tasks.discard)

    async def evaluate(self, version: int) -> dict[str, float]:
        """Greedy episodes on held-out tasks (eval kwargs, seeds disjoint from training's)."""
        cfg = self.cfg
        manager = RolloutManager(self.engine, self.loaded, sampling=replace(self.sampling, temperature=0.0),
                                 limits=self.manager.limits, max_concurrency=cfg.rollout.concurrency)
        results: dict[str, list[float]] = {}
        try:
            for env in cfg.envs:
                kwargs = {**env.kwargs, **env.eval_kwargs}
                trajs = await manager.run(env.id, cfg.trainer.eval_tasks, 1, seed=EVAL_SEED_OFFSET,
                                          env_kwargs=kwargs)
                results[env.id] = [t.reward for t in trajs]
        finally:
            await manager.close()
        return self.log.eval(version, results)

    # --- checkpoints ------------------------------------------------------------------
    def _checkpoint(self) -> None:
        self.checkpoints.save(self.backend, self.step, {"step": self.step, "next_task": self.next_task})

    async def _resume(self) -> None:
        """Continues from the latest checkpoint, if any: weights, optimizer, RNG, data position, metrics."""
        extra = self.checkpoints.load_latest(self.backend)
        if extra is None:
            return
        self.step = int(extra["step"])
        self.next_task = int(extra["next_task"])
        self.log.truncate_after(self.step)
        await self._push_weights()  # the engine was built from the initial weights


async def _finish_step(step: Any) -> None:
    """Runs a training step to its end even if the run is interrupted meanwhile (its update runs in a
    thread, and a checkpoint taken halfway through would not match the logged step)."""
    job = asyncio.ensure_future(step)
    try:
        await asyncio.shield(job)
    except asyncio.CancelledError:
        await job
        raise


def _yaml(cfg: TrainConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Runs a training job; under torchrun, rank 0 trains and the other ranks follow its backend calls."""
    rank, size = world()
    if size > 1 and cfg.trainer.backend != "megatron":
        raise ValueError("only trainer.backend=megatron runs under torchrun; the torch backend is one process")
    if rank == 0:
        return asyncio.run(Trainer(cfg).run())
    backend = make_backend(cfg, load_model(cfg.model))
    calls = follow(backend, make_loss_fn(cfg.algorithm.to_algorithm_config()))
    return {"rank": rank, "backend_calls": calls, "version": backend.version}
