"""The distributed run's roles as plain classes: an engine, a rollout worker, a trainer rank.

Each is what one Ray actor runs (`ray.remote(cls)` wraps it at creation, so the class itself imports no Ray and
can be built and called directly). Every role builds its own model from the run's config in its own process:
nothing large crosses a process boundary at creation. What the controller watches is progress, not liveness:
each role reports when it last finished something while it had work in flight.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch

from relax_gym.cpu.process import prepare_process, settle_heap
from relax_gym.engines.base import Engine, GenerateOutput, GenerateRequest, SamplingParams
from relax_gym.engines.embedded import EmbeddedEngine, engine_device, engine_dtype
from relax_gym.engines.pushed_adapters import PushedAdapters
from relax_gym.engines.router import EngineRouter
from relax_gym.engines.sglang import SGLangEngine
from relax_gym.env.registration import resolve_env_id
from relax_gym.rollout.evaluation import EVAL_SEED_OFFSET
from relax_gym.rollout.manager import RolloutManager
from relax_gym.trainer.backends.forwarding import answer
from relax_gym.trainer.config import TrainConfig
from relax_gym.trajectory import Trajectory


def pushed_adapters(cfg: TrainConfig) -> tuple[int, int] | None:
    """(rank, adapters kept) where a cluster run pushes its LoRA adapter alone, loaded by name: to the vLLM or SGLang
    servers its engine actors start, by disk; None where it pushes weights (embedded engines take the merged
    adapted layers, which decode faster than unmerged ones)."""
    c = cfg.cluster
    if c is None or c.engines.kind not in ("vllm", "sglang") or c.weight_sync != "disk":
        return None
    return cfg.trainer.served_adapters()


class Progress:
    """Work in flight and when the last piece of it finished: a role with work and no completion for a while is
    stalled, whatever its process says about itself."""

    def __init__(self) -> None:
        self.inflight = 0
        self.done = 0
        self.last_done = time.monotonic()

    def begin(self) -> None:
        if self.inflight == 0:  # idle time is not stall time
            self.last_done = time.monotonic()
        self.inflight += 1

    def end(self) -> None:
        self.inflight -= 1
        self.done += 1
        self.last_done = time.monotonic()

    def stats(self) -> dict[str, Any]:
        return {"inflight": self.inflight, "done": self.done, "idle_s": time.monotonic() - self.last_done}


class EngineService:
    """One inference engine (the embedded transformers engine over the run's model).

    `fault` injects a deterministic failure for tests and the chaos benchmark: `{"hang_after": n}` makes every
    request after the n-th (and every probe) wait forever; `{"crash_after": n}` ends the process at the n-th.
    """

    def __init__(self, engine_id: str, cfg: TrainConfig, fault: dict[str, int] | None = None):
        from relax_gym.trainer.policy import load_policy

        prepare_process()
        self.engine_id = engine_id
        self.engine = EmbeddedEngine(load_policy(cfg), max_batch_size=cfg.rollout.engine_max_batch_size,
                                     seed=cfg.seed, batching=cfg.rollout.engine_batching,
                                     device=engine_device(cfg.rollout.engine_device),
                                     dtype=engine_dtype(cfg.rollout.engine_dtype))
        self.progress = Progress()
        self.fault = dict(fault or {})
        settle_heap()

    def ready(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "pid": os.getpid(), "version": self.engine.weight_version}

    async def serve_http(self, host: str, api_key: str) -> str:
        """Serves the engine over SGLang's native routes (`relax-gym serve`'s app) from this process, on a free
        port of `host`, and returns its URL: rollout workers then reach it over HTTP, as they would an SGLang
        server, and the server dies with the actor."""
        from relax_gym.engines.server import create_app
        from relax_gym.engines.server_limits import ServerLimits
        from relax_gym.web.serve import InLoopServer

        limits = ServerLimits()
        app = create_app(cast(EmbeddedEngine, _Counted(self.engine, self)), api_key=api_key, limits=limits)
        self._http = InLoopServer(app, limits.bounds, host, 0, name="engine's HTTP server")
        return await self._http.start()

    def _requests_seen(self) -> int:
        return self.progress.done + self.progress.inflight

    def _hung(self) -> bool:
        return "hang_after" in self.fault and self._requests_seen() > self.fault["hang_after"]

    async def _maybe_fail(self) -> None:
        if "crash_after" in self.fault and self._requests_seen() >= self.fault["crash_after"]:
            os._exit(1)
        if self._hung():
            await asyncio.Event().wait()

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.progress.begin()
        try:
            await self._maybe_fail()
            return await self.engine.generate(request)
        finally:
            self.progress.end()

    async def update_weights(self, weights: dict[str, torch.Tensor] | str | Path, version: int) -> int:
        """Loads `weights` (a state dict, or an HF folder: the disk strategy) between batches (running ones finish
        first) and returns the version now loaded."""
        await self.engine.pause()
        try:
            await self.engine.update_weights(weights, version)
        finally:
            await self.engine.resume()
        return self.engine.weight_version

    async def probe(self) -> bool:
        """One greedy token, as SGLang's /health_generate: an engine that cannot produce it is not healthy."""
        if self._hung():
            await asyncio.Event().wait()
        request = GenerateRequest([self.engine.pad_token_id], SamplingParams(temperature=0, max_new_tokens=1))
        await self.engine.generate(request)
        return True

    def stats(self) -> dict[str, Any]:
        return {**self.progress.stats(), "version": self.engine.weight_version}


class ServerSupervisor:
    """An engine that is a server process of its own (SGLang's `launch_server`, or `cluster.engines.launch`; vLLM's
    API server as `launch_vllm_server` starts it, on the run's model folder),
    started and owned by this actor: the server gets the actor's GPUs and dies with it. Workers reach it over
    HTTP; the health manager sees no progress from here (no `stats`), so it probes the server itself."""

    def __init__(self, engine_id: str, cfg: TrainConfig):
        assert cfg.cluster is not None
        self.engine_id = engine_id
        self.cfg = cfg
        self.server: Any = None

    def ready(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "pid": os.getpid(), "version": 0}

    async def serve_http(self, host: str, api_key: str) -> str:
        """Starts the server on a free port of `host` and returns its URL once /health answers. The thread that
        starts it stays its parent for its whole life, so the kernel kills it when this actor dies."""
        from relax_gym.engines.sglang import launch_sglang_server
        from relax_gym.engines.sglang import lora_args as sglang_lora_args
        from relax_gym.engines.vllm import launch_vllm_server, model_folder
        from relax_gym.trainer.policy import load_policy

        assert self.cfg.cluster is not None
        c = self.cfg.cluster.engines
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        loop = asyncio.get_running_loop()
        started: asyncio.Future[Any] = loop.create_future()

        def parent() -> None:
            server: Any
            try:
                if c.kind == "vllm":
                    folder = path if os.path.isdir(path := os.path.expanduser(str(self.cfg.model.path))) else \
                        model_folder(load_policy(self.cfg))
                    server = launch_vllm_server(folder, port, host=host, api_key=api_key,
                                                extra=c.args, max_model_len=self.cfg.rollout.max_total_tokens,
                                                die_with_parent=True, lora=pushed_adapters(self.cfg))
                else:
                    lora = sglang_lora_args(*adapters) if (adapters := pushed_adapters(self.cfg)) else []
                    server = launch_sglang_server(self.cfg.model.path, port, "--tp-size", str(c.tp), "--api-key",
                                                  api_key, *lora, *c.args, host=host, command=c.launch,
                                                  die_with_parent=True)
            except BaseException as err:
                loop.call_soon_threadsafe(started.set_exception, err)
                return
            loop.call_soon_threadsafe(started.set_result, server)
            server.process.wait()

        threading.Thread(target=parent, name=f"{self.engine_id}-server", daemon=True).start()
        self.server = await started
        return str(self.server.url)



class _Counted:
    """The engine as the HTTP app sees it, with every generation counted in its service's progress (the health
    manager's view of an engine served over HTTP) and faults injected as for actor calls."""

    def __init__(self, engine: EmbeddedEngine, service: EngineService):
        self._engine = engine
        self._service = service

    async def generate(self, request: GenerateRequest, *, timeout_s: float | None = None) -> GenerateOutput:
        self._service.progress.begin()
        try:
            await self._service._maybe_fail()
            return await self._engine.generate(request, timeout_s=timeout_s)
        finally:
            self._service.progress.end()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class RolloutWorker:
    """A rollout manager and its env pools over an engine router: plays whole groups and returns them by value
    (so a group outlives the worker that played it). The controller tells it which engines it may use."""

    def __init__(self, worker_id: str, cfg: TrainConfig, *, engine_wait_s: float):
        from relax_gym.trainer.policy import load_policy

        prepare_process()
        self.worker_id = worker_id
        for env in cfg.envs:  # an env given as file.py or module registers its ids in this process too
            resolve_env_id(env.id)
        loaded = load_policy(cfg)
        r = cfg.rollout
        self.router = EngineRouter(wait_s=engine_wait_s)  # its engines come with `set_engines`
        self.epoch = -1
        self.manager = RolloutManager(self.router, loaded, sampling=r.sampling_params(), limits=r.limits(),
                                      max_concurrency=r.concurrency, sampling_seed=cfg.seed,
                                      routed_experts=cfg.algorithm.routing_replay)
        self.eval_manager = RolloutManager(self.router, loaded, limits=r.limits(), max_concurrency=r.concurrency,
                                           sampling=replace(r.sampling_params(),
                                                            temperature=cfg.trainer.eval_temperature),
                                           sampling_seed=EVAL_SEED_OFFSET)  # draws as `relax-gym eval` does
        self.eval_samples = cfg.trainer.eval_samples
        self.progress = Progress()
        settle_heap()

    def ready(self) -> dict[str, Any]:
        import ray  # only ever called in an actor

        return {"worker_id": self.worker_id, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def set_engines(self, epoch: int, engines: dict[str, Engine]) -> None:
        """The engines routable from now on (an older epoch arriving late is ignored)."""
        if epoch > self.epoch:
            self.epoch = epoch
            self.router.set_members(engines)

    def adopt_adapter(self, folder: str, version: int) -> None:
        """The run's adapter of `version` (its folder), which the fleet has loaded on every engine server: requests
        starting from now name it, so their tokens carry its version."""
        for engine in self.router.members.values():
            if isinstance(adapters := getattr(engine, "adapters", None), PushedAdapters):
                adapters.note(Path(folder), version)

    async def run_group(self, env_id: str, seed: int, group_size: int,
                        env_kwargs: dict[str, Any]) -> list[Trajectory]:
        self.progress.begin()
        try:
            return await self.manager.run_group(env_id, seed, group_size, env_kwargs=env_kwargs)
        finally:
            self.progress.end()

    async def run_eval(self, env_id: str, n_tasks: int, seed: int, env_kwargs: dict[str, Any]) -> list[Trajectory]:
        """Held-out evaluation: `trainer.eval_samples` episodes per task at `trainer.eval_temperature`."""
        self.progress.begin()
        try:
            return await self.eval_manager.run(env_id, n_tasks, self.eval_samples, seed=seed, env_kwargs=env_kwargs)
        finally:
            self.progress.end()

    def stats(self) -> dict[str, Any]:
        return {**self.progress.stats(), "failovers": self.router.failovers}


class TrainerRank:
    """One trainer rank: the training backend in its own process. Rank 0 is what the loop calls, like a local
    backend; with several ranks (Megatron's TP / PP / DP, instead of torchrun) it announces each call to the
    others, which repeat it (`trainer.distributed`: `DrivingBackend` and `follow`).

    The backend is built by `setup`, called on every rank at once (forming the process group waits for all).
    `fault` injects a deterministic failure for tests and the chaos benchmark: `{"crash_at_step": n}` ends the
    process when asked to train step n, `{"raise_at_step": n}` raises there (a bug, not a lost process),
    `{"hang_at_step": n}` never answers."""

    def __init__(self, cfg: TrainConfig, fault: dict[str, int] | None = None):
        prepare_process()
        self.cfg = cfg
        self.fault = dict(fault or {})
        self.rank = 0
        self.backend: Any = None
        self._control: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._publisher: Any = None
        self._members: list[str] = []
        self._groups = 0

    def address(self) -> tuple[str, int]:
        """Where the group's rendezvous listens (asked of rank 0): this node and a free port on it."""
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, rank: int, world_size: int, master: tuple[str, int] | None) -> dict[str, Any]:
        """Builds the backend as rank `rank` of `world_size` (torchrun's environment variables, so the backend
        forms its process group as under torchrun: Ray gives each rank its own GPU as device 0)."""
        from relax_gym.trainer.distributed import DrivingBackend, control_group
        from relax_gym.trainer.policy import load_policy, make_backend

        self.rank = rank
        if world_size > 1:
            assert master is not None
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                              MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        torch.manual_seed(self.cfg.seed)
        self.loaded = load_policy(self.cfg)
        backend = make_backend(self.cfg, self.loaded)
        self.backend = DrivingBackend(backend) if world_size > 1 and rank == 0 else backend
        if rank > 0:  # rank 0's DrivingBackend made its side of the control group just now
            self._control = control_group()
        settle_heap()
        return self.ready()

    def follow(self) -> int:
        """A rank > 0's whole life: repeats rank 0's calls until it stops (returns the number of calls)."""
        from relax_gym.trainer.algorithms import make_loss_fn
        from relax_gym.trainer.distributed import follow

        return follow(self.backend, make_loss_fn(self.cfg.algorithm.to_algorithm_config()), self._control)

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "rank": self.rank, "version": self.backend.version if self.backend else 0}

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
        """A `TrainBackend` call from `RemoteBackend` (`backends.forwarding.answer`), after the injected fault of
        the step it would train, if any."""
        if method == "train_step":
            step = self.backend.version + 1
            if self.fault.get("crash_at_step") == step:
                os._exit(1)
            if self.fault.get("raise_at_step") == step:
                raise ValueError(f"injected fault: raise_at_step={step}")
            if self.fault.get("hang_at_step") == step:
                threading.Event().wait()
        return answer(self.backend, method, args, kwargs)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.backend.hf_state_dict()

    def publish_distributed(self, servers: list[SGLangEngine], *, master_address: str, backend: str,
                            timeout_s: float, alone: bool = False) -> int:
        """Broadcasts the current weights to `servers` (HTTP clients, each with its server's key) over a
        torch.distributed group driven by SGLang's routes (`DistributedPublisher`); returns the version sent.
        The run's group is kept while its members stay the same and formed again (under a new name) when they
        change or a publication failed; `alone` sends to a joining server through a group of its own, so the run's
        group is left as it is."""
        return self._in_loop(self._publish(servers, master_address, backend, timeout_s, alone))

    async def _publish(self, servers: list[SGLangEngine], master_address: str, backend: str, timeout_s: float,
                       alone: bool) -> int:
        from relax_gym.trainer.weight_publish import DistributedPublisher

        self._groups += 1
        name = f"relax-gym-weights-{os.getpid()}-{self._groups}"
        urls = [s.base_url for s in servers]
        if alone or self._publisher is None or self._members != urls:
            if not alone and self._publisher is not None:
                await self._close_publisher()
            publisher = DistributedPublisher(servers, backend=backend, master_address=master_address,
                                             group_name=name, timeout_s=timeout_s)
            await publisher.connect()
            if not alone:
                self._publisher, self._members = publisher, urls
        else:
            publisher = self._publisher
        try:
            await publisher.publish(self.backend.hf_state_dict(), self.backend.version)
        except BaseException:
            if publisher is self._publisher:
                await self._close_publisher()
            raise
        finally:
            if alone:
                await publisher.close()
        return int(self.backend.version)

    async def _close_publisher(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            await publisher.close()

    def _in_loop(self, coro: Any) -> Any:
        """Runs `coro` on this rank's own event loop (a thread of its own: the HTTP clients and groups of the
        distributed publication outlive one call)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="relax-gym-publisher", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def save_adapter(self, folder: str) -> None:
        """A LoRA run's adapter alone as a PEFT folder (`cluster.weight_sync: disk` to vLLM or SGLang servers,
        which load it by name): the few MB the adapter holds, not the merged model."""
        from relax_gym.models.lora import write_adapter

        lora = self.cfg.trainer.lora
        assert lora is not None
        write_adapter(Path(folder), self.backend.adapter_state_dict(), lora.spec(), self.loaded.model,
                      self.loaded.name)

    def save_weights(self, folder: str) -> None:
        """The current weights as an HF folder an engine loads (`cluster.weight_sync: disk`). A LoRA run's are its
        merged adapted layers, laid over this rank's copy of the base first, so the folder is whole."""
        from relax_gym.models.loading import save_pretrained_folder

        loaded = self.loaded
        weights = self.backend.hf_state_dict()
        if self.cfg.trainer.lora is not None:
            loaded.model.load_state_dict(weights, strict=False)
            weights = None
        save_pretrained_folder(Path(folder), loaded.model, loaded.processor or loaded.tokenizer, state_dict=weights)

