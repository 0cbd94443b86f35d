"""The rollout manager: many concurrent multi-turn episodes against one engine.

Each episode alternates engine generation and env steps, appending exact
tokens (see `tokens.py`). Nothing an env or the engine does can crash a run:
an env exception makes a `failed` trajectory, an engine error or a timeout an
`aborted` one, each with its reason, and the other episodes go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from relax_gym.engines.base import (
    Engine,
    EngineError,
    EngineUnavailableError,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
    request_seed,
)
from relax_gym.env.agent_env import AgentEnv
from relax_gym.env.core import Env
from relax_gym.env.registration import make
from relax_gym.env.seats import GameEndedError, GameTable, SeatedGame, SeatView
from relax_gym.messages import Message, text_content
from relax_gym.models import LoadedModel
from relax_gym.models.moe_routing import experts_per_token, request_routes
from relax_gym.rollout.config import MAX_CONCURRENCY, RolloutLimits
from relax_gym.rollout.tokens import ConversationTokens, PromptCache, TemplateError
from relax_gym.tools.formats import tool_format_of
from relax_gym.trajectory import Status, Trajectory

if TYPE_CHECKING:
    from relax_gym.rollout.agent_proxy import ProxyServer


#: the start of an aborted episode's reason when its engine stayed unreachable past the client's outage timeout
ENGINE_UNAVAILABLE = "engine unavailable"


class EnvPool:
    """Reuses env instances across episodes: making some envs reads data files."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None):
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self._idle: list[Env] = []

    def acquire(self) -> Env:
        return self._idle.pop() if self._idle else make(self.env_id, **self.env_kwargs)

    def release(self, env: Env, healthy: bool) -> None:
        if healthy:
            self._idle.append(env)
        else:
            env.close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()

    def policy_seats(self) -> int:
        """How many seats of each game the policy plays (`SeatedGame`); 1 for any other env, or one that cannot
        be made (its episodes then record why)."""
        try:
            env = self.acquire()
        except Exception:
            return 1
        self.release(env, healthy=True)
        return env.policy_seats if isinstance(env, SeatedGame) else 1


class RolloutManager:
    def __init__(
        self,
        engine: Engine,
        loaded: LoadedModel,
        *,
        sampling: SamplingParams | None = None,
        limits: RolloutLimits | None = None,
        max_concurrency: int = MAX_CONCURRENCY,
        sampling_seed: int | None = None,
        routed_experts: bool = False,
    ):
        """`routed_experts`: every request asks the engine for the experts each MoE layer routed every token to,
        and each trajectory keeps its last request's (`Trajectory.routed_experts`), for routing replay."""
        self.engine = engine
        self.loaded = loaded
        self.sampling = sampling or SamplingParams()
        self.limits = limits or RolloutLimits()
        self._slots = asyncio.Semaphore(max_concurrency)
        #: held while a game takes a slot for each of its seats, so two games never each hold part of theirs
        self._admission = asyncio.Lock()
        self.max_concurrency = max_concurrency
        self._threads_for: asyncio.AbstractEventLoop | None = None
        self._pools: dict[tuple[str, str], EnvPool] = {}
        self.eos_ids = loaded.stop_token_ids()
        #: given to every env that reads tool calls (`ToolEnv.tool_format`) and was not made with a format
        self.tool_format = tool_format_of(loaded)
        #: when set, every request is seeded from (this, task seed, member of the group, turn), so a
        #: run's samples do not depend on request timing or batching
        self.sampling_seed = sampling_seed
        #: a group's episodes share their prompt's render (see `PromptCache`)
        self.prompts = PromptCache()
        #: the agent proxy's server, made by the first agent episode (a run without agents never imports it)
        self.agent_server: ProxyServer | None = None
        #: with `routed_experts`, the model's experts per token (what shapes the engine's flat routes)
        self.routes_top_k: int | None = None
        if routed_experts:
            self.routes_top_k = experts_per_token(loaded.model.config)
            if self.routes_top_k is None:
                raise ValueError(f"routed experts: model {loaded.name!r} is not a mixture of experts "
                                 "(its config has no num_experts_per_tok)")

    def pool(self, env_id: str, env_kwargs: dict[str, Any] | None = None) -> EnvPool:
        key = (env_id, repr(sorted((env_kwargs or {}).items())))
        if key not in self._pools:
            self._pools[key] = EnvPool(env_id, env_kwargs)
        return self._pools[key]

    # --- public API -----------------------------------------------------------------
    async def run_group(self, env_id: str, seed: int, group_size: int, *,
                        env_kwargs: dict[str, Any] | None = None) -> list[Trajectory]:
        """`group_size` episodes of the same task (same reset seed), for group-relative advantages; of a
        `SeatedGame`, `group_size` games, each seat an episode (see `relax_gym.env.seats`)."""
        pool = self.pool(env_id, env_kwargs)
        group_id = f"{env_id}#{seed}"
        if pool.policy_seats() > 1:
            games = await asyncio.gather(*(self.run_game(pool, seed, group_id, game) for game in range(group_size)))
            return [t for seats in games for t in seats]
        episodes = await asyncio.gather(*(self.run_episode(pool, seed, group_id, member)
                                          for member in range(group_size)))
        return [t for samples in episodes for t in samples]

    async def run(self, env_id: str, n_tasks: int, group_size: int = 1, *, seed: int = 0,
                  env_kwargs: dict[str, Any] | None = None,
                  on_group: Callable[[list[Trajectory]], None] | None = None) -> list[Trajectory]:
        """All groups concurrently; `on_group` sees each group as it finishes (to write it out at once)."""

        async def one(i: int) -> list[Trajectory]:
            group = await self.run_group(env_id, seed + i, group_size, env_kwargs=env_kwargs)
            if on_group is not None:
                on_group(group)
            return group

        groups = await asyncio.gather(*(one(i) for i in range(n_tasks)))
        return [t for g in groups for t in g]

    def _ensure_threads(self) -> None:
        """Gives the running loop a thread pool as large as the episode concurrency.

        Blocking envs step in the loop's default executor (`asyncio.to_thread`),
        whose stock size is min(32, cpus + 4): with a 50 ms judge call per step, 6
        threads would serve 256 concurrent episodes 6 at a time.
        """
        loop = asyncio.get_running_loop()
        if self._threads_for is not loop:
            workers = min(self.max_concurrency, 512)
            loop.set_default_executor(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="relax-env"))
            self._threads_for = loop

    async def run_episode(self, pool: EnvPool, seed: int, group_id: str = "",
                          member: int = 0) -> list[Trajectory]:
        """One episode's samples: its trajectory, or an agent episode's (one per chain of calls, see
        `relax_gym.rollout.agent_proxy`)."""
        self._ensure_threads()
        async with self._slots:
            try:
                env = pool.acquire()
            except Exception as err:  # a bad kwarg or data file: the episode records why, the caller decides
                episode = _Episode(self, None, pool.env_id, seed, group_id, member)
                episode.end("failed", f"env make raised {type(err).__name__}: {err}")
                return [episode.trajectory()]
            if isinstance(env, AgentEnv):
                from relax_gym.rollout.agent_episode import play_agent
                from relax_gym.rollout.agent_proxy import ProxyServer

                if self.agent_server is None:
                    self.agent_server = ProxyServer(self.engine, self.loaded, self.sampling, self.limits,
                                                    routes_top_k=self.routes_top_k)
                try:
                    return await play_agent(self.agent_server, env, pool.env_id, seed, group_id, member,
                                            sampling_seed=self.sampling_seed, timeout_s=self.limits.episode_timeout_s)
                finally:
                    pool.release(env, healthy=True)
            if hasattr(env, "tool_format") and "tool_format" not in vars(env):
                env.tool_format = self.tool_format  # the model's format, unless the env was made with one
            episode = _Episode(self, env, pool.env_id, seed, group_id, member)
            try:
                await asyncio.wait_for(episode.play(), timeout=self.limits.episode_timeout_s)
            except TimeoutError:
                episode.end("aborted", f"episode timed out after {self.limits.episode_timeout_s}s")
            finally:
                # an aborted episode's env may still be inside a step in a worker thread (a timeout
                # cancels the await, not the thread): only envs that ended cleanly are reused
                pool.release(env, healthy=episode.status in ("completed", "truncated"))
            return [episode.trajectory()]

    @contextlib.asynccontextmanager
    async def _seat_slots(self, seats: int) -> AsyncIterator[None]:
        """A concurrency slot for each seat of a game, all at once: seats wait on each other's moves, so a game
        holding some slots while its other seats wait for more would never end."""
        if seats > self.max_concurrency:
            raise ValueError(f"a game of {seats} policy seats needs rollout.concurrency >= {seats} "
                             f"(it is {self.max_concurrency}): its seats play at the same time")
        held = 0
        try:
            async with self._admission:
                for _ in range(seats):
                    await self._slots.acquire()
                    held += 1
            yield
        finally:
            for _ in range(held):
                self._slots.release()

    async def run_game(self, pool: EnvPool, seed: int, group_id: str, game: int) -> list[Trajectory]:
        """One game of a `SeatedGame`, each policy seat an episode with the group id `{group_id}@seat{N}` (its
        own advantage baseline); a seat whose episode ends early ends the game for the others."""
        self._ensure_threads()
        seats = pool.policy_seats()
        async with self._seat_slots(seats):
            try:
                env = pool.acquire()
            except Exception as err:
                episode = _Episode(self, None, pool.env_id, seed, group_id, game)
                episode.end("failed", f"env make raised {type(err).__name__}: {err}")
                return [episode.trajectory()]
            assert isinstance(env, SeatedGame)
            table = GameTable(env)
            episodes = [_Episode(self, SeatView(table, seat), pool.env_id, seed, f"{group_id}@seat{seat}",
                                 game * seats + seat) for seat in range(seats)]

            async def play(seat: int, episode: _Episode) -> None:
                try:
                    await asyncio.wait_for(episode.play(), timeout=self.limits.episode_timeout_s)
                except TimeoutError:
                    episode.end("aborted", f"episode timed out after {self.limits.episode_timeout_s}s")
                finally:
                    await table.leave(seat, episode.reason or str(episode.status))

            try:
                await asyncio.gather(*(play(seat, episode) for seat, episode in enumerate(episodes)))
            finally:
                pool.release(env, healthy=all(e.status in ("completed", "truncated") for e in episodes))
        return [episode.trajectory() for episode in episodes]

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        if self.agent_server is not None:
            await self.agent_server.stop()


class _Episode:
    """The state of one running episode; `play` fills it, `trajectory` freezes it."""

    def __init__(self, manager: RolloutManager, env: Env | None, env_id: str, seed: int, group_id: str,
                 member: int):
        self.m, self.env, self.env_id, self.seed, self.group_id = manager, env, env_id, seed, group_id
        self.member = member
        self.conv: ConversationTokens | None = None
        self.status: Status | None = None
        self.reason = ""
        self.step_rewards: list[float] = []
        self.infos: list[dict[str, Any]] = []
        self.task = ""
        self.timing = {"generate_s": 0.0, "env_s": 0.0}
        #: the last request's routed experts (manager.routes_top_k set): [tokens, layers, top_k]
        self.routes: np.ndarray | None = None

    def end(self, status: Status, reason: str = "") -> None:
        if self.status is None:
            self.status, self.reason = status, reason

    async def _env_call(self, what: str, coro: Any) -> Any:
        start = time.perf_counter()
        try:
            return await coro
        except GameEndedError as err:  # a self-play game another seat ended: nothing broke, nothing to train
            self.end("truncated", str(err))
            return None
        except Exception as err:
            frame = traceback.extract_tb(err.__traceback__)[-1]
            self.end("failed", f"env {what} raised {type(err).__name__}: {err} ({frame.filename}:{frame.lineno})")
            return None
        finally:
            self.timing["env_s"] += time.perf_counter() - start

    async def play(self) -> None:
        m, env = self.m, self.env
        assert env is not None
        reset = await self._env_call("reset", env.areset(seed=self.seed))
        if reset is None:
            return
        obs, info = reset
        self.infos.append(info)
        try:
            messages = env.format_observation(obs)
            self.task = _task_text(messages)
            self.conv = ConversationTokens.start(m.loaded, messages, getattr(env, "tool_schemas", None) or None,
                                                 cache=m.prompts)
        except (TemplateError, ValueError) as err:
            self.end("failed", f"could not render the prompt: {err}")
            return
        while self.status is None:
            budget = m.limits.max_total_tokens - len(self.conv.token_ids)
            if budget <= 0:
                self.end("truncated", "token_budget")
                return
            sampling = m.sampling
            if budget < sampling.max_new_tokens:
                sampling = replace(sampling, max_new_tokens=budget)
            if m.sampling_seed is not None:
                sampling = replace(sampling, seed=request_seed(m.sampling_seed, self.seed, self.member,
                                                               self.conv.turns))
            request = self.conv.request(sampling, f"{self.group_id}/{self.member}/{self.conv.turns}",
                                        return_routed_experts=m.routes_top_k is not None)
            start = time.perf_counter()
            try:
                out = await m.engine.generate(request)
            except EngineUnavailableError as err:
                self.end("aborted", f"{ENGINE_UNAVAILABLE}: {err}")
                return
            except (EngineError, OSError) as err:
                self.end("aborted", f"engine: {err}")
                return
            finally:
                self.timing["generate_s"] += time.perf_counter() - start
            if m.routes_top_k is not None and not self._keep_routes(request, out, m.routes_top_k):
                return
            action = self.conv.append_generation(out.output_ids, out.logprobs, out.versions(), m.eos_ids)
            if out.finish_reason == "abort":
                self.end("aborted", "engine aborted the request")
                return
            if out.finish_reason == "length":
                self.end("truncated", "token_budget" if sampling.max_new_tokens < m.sampling.max_new_tokens
                         else "max_new_tokens")
                return
            stepped = await self._env_call("step", env.astep(action))
            if stepped is None:
                return
            obs, reward, terminated, truncated, info = stepped
            self.step_rewards.append(float(reward))
            self.infos.append(info)
            if terminated:
                self.end("completed")
                return
            if truncated:
                self.end("truncated", str(info.get("truncated_by", "env")))
                return
            if self.conv.turns >= m.limits.max_turns:
                self.end("truncated", "max_turns")
                return
            try:
                observation = env.format_observation(obs)
                left = m.limits.max_total_tokens - len(self.conv.token_ids)
                if _text_chars(observation) > left * m.loaded.max_token_chars:  # no tokenizer time on what can't fit
                    self.end("truncated", "token_budget")
                    return
                self.conv.append_observation(observation)
            except (TemplateError, ValueError) as err:
                self.end("failed", f"could not render the observation: {err}")

    def _keep_routes(self, request: GenerateRequest, out: GenerateOutput, top_k: int) -> bool:
        """Keeps `out`'s routed experts (`request_routes`); an engine that gave none, or a number that does not
        fit, aborts the episode (False)."""
        try:
            self.routes = request_routes(request, out, top_k)
        except ValueError as err:
            self.end("aborted", f"engine: {err}")
            return False
        return True

    def trajectory(self) -> Trajectory:
        conv = self.conv
        metrics: dict[str, Any] = {
            **{k: round(v, 6) for k, v in self.timing.items()},
            "turns": conv.turns if conv else 0,
            "tool_calls": sum(int(i.get("tool_calls", 0)) for i in self.infos[-1:]),
            "tool_errors": sum(int(i.get("tool_errors", 0)) for i in self.infos[-1:]),
        }
        reward_status = (self.infos[-1].get("reward") or {}).get("status") if self.infos else None
        if reward_status:
            metrics["reward_status"] = reward_status
        if conv is not None and self.m.limits.check_rerender and conv.turns:
            diff = conv.template_diff()
            metrics["rerender_match"] = diff is None
            if diff is not None:
                metrics["rerender_first_diff_char"] = diff
                # strict appending kept the tokens the model saw; a template that rewrites history
                # (drops old reasoning, moves the system prompt) re-renders them differently by design
                metrics["rerender_expected"] = conv.rewrites_history()
        traj = Trajectory(
            token_ids=conv.token_ids if conv else [],
            prompt_len=conv.prompt_len if conv else 0,
            loss_mask=conv.loss_mask if conv else [],
            rollout_logprobs=conv.logprobs if conv else [],
            versions=conv.versions if conv else [],
            reward=float(sum(self.step_rewards)),
            step_rewards=self.step_rewards,
            status=self.status or "aborted",
            status_reason=self.reason,
            group_id=self.group_id,
            env_id=self.env_id,
            task=self.task,
            segments=conv.segments if conv else [],
            media=conv.media if conv else [],
            mm_inputs=conv.mm_inputs() if conv else {},
            metrics=metrics,
            infos=self.infos,
            seed=self.seed,
            routed_experts=self.routes,
        )
        traj.check()
        return traj


def _text_chars(messages: Sequence[Message]) -> int:
    """The characters of `messages`' text parts: an upper bound, through `LoadedModel.max_token_chars`, on the
    tokens they can take off the budget, known before any tokenizing."""
    return sum(len(text_content(m)) for m in messages)


def _task_text(messages: Sequence[Message]) -> str:
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        return ""
    return " ".join(p["text"] for p in users[-1]["content"] if p["type"] == "text")[:500]
