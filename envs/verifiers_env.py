"""Any verifiers taskset (https://github.com/PrimeIntellect-ai/verifiers, v1) by its name, trained as an `AgentEnv`.

verifiers v1 has no reset/step: a `Taskset` yields `Task`s whose `@vf.reward` methods score a finished trace,
and a `Harness` program plays each task against an OpenAI-style endpoint through verifiers' interception server,
which records that trace. So an episode here is verifiers' own episode (`Env.run_episode`: the task's setup, the
harness, the scoring) with the model endpoint set to the episode's session of the agent proxy, which records the
exact tokens; the reward is the trace's, the sum of its weighted `@vf.reward` scores.

- Local only. verifiers runs agents in Prime's cloud sandboxes by default; here every agent runs in a local
  runtime (`subprocess`, or a container one named by `runtime`), and a cloud runtime, for an agent or a tool
  server, is refused.
- One interception server per run. The rollout manager makes an env per concurrent episode; the envs made with
  one config share one verifiers env, served on its own thread's event loop from the first episode until the
  last of them closes. Each episode's proxy session is its own endpoint: the client verifiers keeps per endpoint
  is made here, given the proxy's key directly (no environment variable, command line or config holds it), and
  dropped when the episode ends.
- The seed draws the task from the taskset's rows, as the dataset envs do.

verifiers is an optional extra, imported when the env is made, not when the id is listed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import threading
from types import ModuleType
from typing import Any

from relax_gym.env.agent_env import AgentEnv
from relax_gym.env.core import Env
from relax_gym.rewards import RewardResult

INSTALL_HINT = "pip install 'relax-gym[verifiers]'"
#: the bundled plugins (`relax_gym.envs.verifiers_chat`): the in-process chat harness and a one-word taskset
HARNESS_ID = "relax-gym-chat"
TASKSET_ID = "relax-gym-words"
LOCAL_RUNTIMES = ("subprocess", "docker", "podman", "apptainer")
#: the model name the harness asks for: the proxy generates with the run's policy whatever the name
MODEL = "policy"
#: the endpoint's key variable, never set (the client is given the key), and not Prime's, for which verifiers
#: reads the Prime CLI's config
KEY_VAR = "RELAX_GYM_AGENT_PROXY_API_KEY"
#: rows taken from a taskset that never ends, unless `size` says
DEFAULT_SIZE = 1000
STOP_TIMEOUT_S = 30.0


def import_verifiers() -> ModuleType:
    """`verifiers.v1`, with the bundled harness and taskset registered under their ids."""
    try:
        vf = importlib.import_module("verifiers.v1")
    except ImportError as err:
        raise ImportError(f"relax/Verifiers-v0 needs the verifiers package: {INSTALL_HINT}") from err
    importlib.import_module("relax_gym.envs.verifiers_chat")
    return vf


def env_config(vf: ModuleType, taskset: str, harness: str | None, harness_args: dict[str, Any],
               runtime: str | dict[str, Any], taskset_args: dict[str, Any]) -> Any:
    """verifiers' env config: one interception server; every agent in `runtime`, and each that pins no harness
    given `harness` (else the taskset's own, else the chat harness)."""
    from verifiers.v1.configs.agent import agent_config_fields

    runtime = {"type": runtime} if isinstance(runtime, str) else dict(runtime)
    if runtime.get("type") not in LOCAL_RUNTIMES:
        raise ValueError(f"runtime must be local, one of {', '.join(LOCAL_RUNTIMES)}; got {runtime.get('type')!r}")
    if harness is None:
        harness = taskset if vf.default_harness_id(taskset) == taskset else HARNESS_ID
    raw: dict[str, Any] = {"taskset": {"id": taskset, **taskset_args}, "interception": {"type": "server"}}
    roles = agent_config_fields(vf.resolve_env_config(raw))
    for name, agent in roles.items():
        pinned = {} if agent.harness is not None else {"harness": {"id": harness, **harness_args}}
        raw[name] = {"runtime": runtime, **pinned}
    return vf.resolve_env_config(raw)


def refuse_cloud_tools(vf_env: Any) -> None:
    """A tool server in a cloud runtime (it would reach the interception through Prime's tunnel) is refused."""
    from verifiers.v1.interception import requires_tunnel

    taskset = vf_env.taskset
    servers = [*type(taskset).task_type().toolsets(taskset.config.task), *taskset.toolsets(taskset.config)]
    if requires_tunnel(True, [server.config for server in servers]):
        raise ValueError(f"taskset {taskset.config.id!r} places a tool server in a cloud runtime; "
                         f"relax/Verifiers-v0 runs locally only ({', '.join(LOCAL_RUNTIMES)})")


class VerifiersError(RuntimeError):
    """A verifiers episode that did not finish (the harness, a hook or the scoring failed)."""


def episode_reward(episode: Any) -> RewardResult:
    """The trainable agents' mean trace reward (a plain taskset's one agent: its reward); VerifiersError with
    verifiers' own error when the episode failed."""
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        why = f"{errors[-1].type}: {errors[-1].message}" if errors else "no error recorded"
        raise VerifiersError(f"verifiers episode failed: {why}")
    traces = [t for t in episode.traces if t.agent.trainable] or episode.traces
    scores = {name: r.score for t in traces for name, r in t.rewards.items() if r is not None}
    return RewardResult(sum(t.reward for t in traces) / len(traces), detail=f"verifiers rewards {scores}")


class _Runner:
    """One config's verifiers env and tasks, shared by the envs made with it; served (one interception server) on
    its own thread's event loop from the first episode until the last of those envs closes."""

    def __init__(self, key: str, vf_env: Any, tasks: list[Any]):
        self.key, self.vf_env, self.tasks = key, vf_env, tasks
        self.users = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._serving: concurrent.futures.Future[Any] | None = None
        self._stack = contextlib.AsyncExitStack()

    def _start(self) -> tuple[asyncio.AbstractEventLoop, concurrent.futures.Future[Any]]:
        with self._lock:
            if self._loop is None or self._serving is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="relax-verifiers", daemon=True)
                self._thread.start()
                self._serving = asyncio.run_coroutine_threadsafe(
                    self._stack.enter_async_context(self.vf_env.serving()), self._loop)
            return self._loop, self._serving

    async def play(self, task: Any, base_url: str, api_key: str) -> Any:
        """verifiers' episode of `task` against the endpoint `base_url`, on the runner's loop."""
        loop, serving = self._start()
        await asyncio.wrap_future(serving)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            self._episode(task, base_url, api_key), loop))

    async def _episode(self, task: Any, base_url: str, api_key: str) -> Any:
        from verifiers.v1.clients import EvalClient, EvalClientConfig, ModelContext

        config = EvalClientConfig(base_url=base_url, api_key_var=KEY_VAR)
        client = EvalClient(config)
        client.api_key = api_key
        # the interception server keeps a client per endpoint config, made from the config's key variable: this
        # one is made here with the key, and goes with the episode (each episode's endpoint is new)
        clients = self.vf_env._interception.clients
        clients[config.model_dump_json()] = client
        try:
            return await self.vf_env.run_episode(task, ModelContext(model=MODEL, client=config))
        finally:
            clients.pop(config.model_dump_json(), None)
            await client.close()

    async def _shutdown(self) -> None:
        current = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not current]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self._stack.aclose()

    def stop(self) -> None:
        """Ends the episodes still running, stops the interception server and the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=STOP_TIMEOUT_S)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(STOP_TIMEOUT_S)
            if not thread.is_alive():
                loop.close()


_RUNNERS: dict[str, _Runner] = {}
_RUNNERS_LOCK = threading.Lock()


def _acquire(vf: ModuleType, config: Any, size: int | None) -> _Runner:
    key = f"{size}:{config.model_dump_json()}"
    with _RUNNERS_LOCK:
        runner = _RUNNERS.get(key)
        if runner is None:
            vf_env = vf.load_environment(config)
            refuse_cloud_tools(vf_env)
            taskset = vf_env.taskset
            if size is not None or not taskset.bounded:
                taskset = taskset.take(DEFAULT_SIZE if size is None else size)
            tasks = list(taskset)
            if not tasks:
                raise ValueError(f"taskset {config.taskset.id!r} has no tasks")
            runner = _RUNNERS[key] = _Runner(key, vf_env, tasks)
        runner.users += 1
        return runner


def _release(runner: _Runner) -> None:
    with _RUNNERS_LOCK:
        runner.users -= 1
        if runner.users > 0:
            return
        _RUNNERS.pop(runner.key, None)
    runner.stop()


class VerifiersEnv(AgentEnv):
    """A verifiers taskset by its id (the installed package verifiers' `vf-eval` takes, e.g. `reverse-text`).

    `harness`: a verifiers harness id for the agents that pin none (`null` is verifiers' chat program, which
    needs `uv`); by default the taskset's own harness, else `relax-gym-chat`, one chat call in this process.
    `harness_args` are that harness's knobs; `runtime` a local runtime's type (or its config as a dict);
    `size` caps the rows (a taskset that never ends gives `DEFAULT_SIZE`). Other kwargs are the taskset's
    config (`--env.taskset.*`).
    """

    metadata: dict[str, Any] = {**Env.metadata, "modalities": ("text",)}  # noqa: RUF012 (see Env.metadata)

    def __init__(self, taskset: str = TASKSET_ID, harness: str | None = None, *,
                 harness_args: dict[str, Any] | None = None, runtime: str | dict[str, Any] = "subprocess",
                 size: int | None = None, **taskset_args: Any):
        vf = import_verifiers()
        config = env_config(vf, taskset, harness, dict(harness_args or {}), runtime, taskset_args)
        self.taskset_id = taskset
        self.runner: _Runner | None = _acquire(vf, config, size)
        rows = [{"index": i, "prompt": t.data.prompt_text} for i, t in enumerate(self.runner.tasks)]
        super().__init__(self._play, rows)

    async def _play(self, client: Any, task: dict[str, Any]) -> RewardResult:
        if self.runner is None:
            raise RuntimeError("the env is closed")
        episode = await self.runner.play(self.runner.tasks[task["index"]], str(client.base_url), client.api_key)
        return episode_reward(episode)

    def close(self) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            _release(runner)
        super().close()
