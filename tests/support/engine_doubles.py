"""The hand-written engine doubles: stand-ins for the `Engine` protocol (`relax_gym.engines.base`) that tests put
where the rollout manager, the router or the train loop expect an engine.

Four wrap a real engine and change one thing (`EndsEachTurn`, `RecordingEngine`, `JitteryEngine`,
`PushRecorder`), one extends the scripted engine (`RecordingScriptedEngine`), and one is a whole fake with no model
behind it (`FakeEngine`). A new double goes here, with what it fakes and why. Two stay where they are made:
`support.cluster.engine_with_latency`'s engine service (built inside a function, so Ray ships it by value to
processes that cannot import this folder) and a test's own three-line variant of `EndsEachTurn`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from relax_gym.engines import EmbeddedEngine, GenerateOutput, GenerateRequest, ScriptedEngine
from relax_gym.engines.base import EngineError


class EndsEachTurn:
    """An engine whose every answer ends its turn: the last generated token becomes `end_id` (finish "stop"), so a
    random model's episodes go on for several turns. That token is the one no forward ran, so its logprob and
    routes are never asked for. It keeps each (request, output); its `after`-th call first runs `on_call` (to
    kill a server mid-rollout).

    Fakes a model that ends its turns, which the random tiny models do not (their episodes would stop at the
    first turn's token limit); the tokens before the last are the real engine's. Used by the agent, remote env and
    routing-replay tests."""

    def __init__(self, inner: EmbeddedEngine, end_id: int, *, after: int | None = None,
                 on_call: Callable[[], None] | None = None):
        self.inner, self.end_id, self.after, self.on_call = inner, end_id, after, on_call
        self.calls = 0
        self.requests: list[tuple[GenerateRequest, GenerateOutput]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.calls += 1
        if self.on_call is not None and self.calls == self.after:
            self.on_call()
        out = await self.inner.generate(request)
        out = replace(out, output_ids=[*out.output_ids[:-1], self.end_id], finish_reason="stop")
        self.requests.append((request, out))
        return out


class RecordingEngine:
    """The real engine, keeping every output it returned, to compare with the trajectories.

    Fakes nothing: it is a tap on a real engine, so a rollout test can hold each trajectory's trained tokens to
    exactly what the engine generated (the rollout manager tests)."""

    def __init__(self, engine):
        self.engine = engine
        self.outputs: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, request):
        out = await self.engine.generate(request)
        self.outputs.append(list(out.output_ids))
        return out


class FakeEngine:
    """An engine that records what it was sent; `fail` makes calls raise, `gate` holds generations.

    Fakes a whole engine, no model behind it (every answer is one token, stamped with its weight version): the
    router's tests choose when a member fails, hangs or answers, which a real engine cannot be made to do on cue."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.seen: list[GenerateRequest] = []
        self.fail: BaseException | None = None
        self.gate: asyncio.Event | None = None
        self.closed = False

    @property
    def weight_version(self) -> int:
        return self.version

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.seen.append(request)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return GenerateOutput([1], [0.0], "stop", self.version, len(request.input_ids))

    async def update_weights(self, weights: Any, version: int) -> None:
        if self.fail is not None:
            raise self.fail
        self.version = version

    async def pause(self) -> None:
        if self.fail is not None:
            raise self.fail

    async def resume(self) -> None:
        if self.fail is not None:
            raise self.fail

    async def connect(self) -> dict[str, Any]:
        if self.fail is not None:
            raise self.fail
        return {"model_path": "fake"}

    async def health(self) -> bool:
        return self.fail is None

    async def close(self) -> None:
        self.closed = True


class RecordingScriptedEngine(ScriptedEngine):
    """A scripted engine that keeps each request's output, to check the trained tokens against.

    Fakes a model that writes a given reply in a family's own tool-call format (the scripted engine's exact
    tokens), and keeps each output by request id: the chat-template family tests check every trained token
    against it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outputs: dict[str, list[int]] = {}

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        out = await super().generate(request)
        self.outputs[request.rid] = list(out.output_ids)
        return out


class JitteryEngine:
    """The real embedded engine behind a random delay per request (latency is what is being varied).

    Fakes a slow, uneven engine (a loaded server's latency) on the real one: the train loop's staleness test
    reorders generations with it. The delay draws from the `random` module, which that test seeds."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, request):
        await asyncio.sleep(random.random() * 0.02)
        return await self.engine.generate(request)


class PushRecorder:
    """The real embedded engine, noting each weight push in `events` 0.2 s after it landed (a slow push), and
    refusing `fail_at`'s.

    Fakes a slow weight push and an engine that refuses one, on the real engine (generation untouched): the train
    loop's tests order the pushes against the updates and stop a run on the refusal."""

    def __init__(self, engine, events: list[tuple[str, int]], fail_at: int | None = None):
        self.engine, self.events, self.fail_at = engine, events, fail_at

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def update_weights(self, weights, version):
        if version == self.fail_at:
            raise EngineError(f"test: the engine refused the weights of step {version}")
        await self.engine.update_weights(weights, version)
        await asyncio.sleep(0.2)
        self.events.append(("pushed", version))
