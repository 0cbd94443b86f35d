"""The Ray transport: clients that make a role's actor look like the local object the loop already uses.

`RayEngineClient` is an `Engine` over an engine actor (the router's member in a rollout worker);
`RemoteBackend` is a `TrainBackend` over the trainer rank's actor (the loop's backend in the driver). A dead
actor surfaces as the error the caller already handles: `EngineGoneError` (the router fails over) and
`TrainerLost` (the controller restarts the trainer from its checkpoint). Calls are never retried by Ray
(`max_task_retries` would silently replay them on a fresh actor holding other weights).
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

from relax_gym.engines.base import EngineGoneError, GenerateOutput, GenerateRequest
from relax_gym.trainer.backends.forwarding import Forwarder

#: what a dead, killed or unreachable actor raises (ActorDiedError, ActorUnavailableError are its subclasses)
ACTOR_GONE = (RayActorError,)


def source_lost(err: BaseException) -> bool:
    """Whether a role's call failed on an argument it could not fetch (the published weights, whose copy and
    maker went down with the trainer rank's node) rather than on its own death: the role lives on."""
    return isinstance(err, RayTaskError) and isinstance(err.cause, (RayActorError, ObjectLostError))


class WeightsLost(RuntimeError):
    """The published weights could not be fetched by any engine: the trainer rank that made them is gone."""


class TrainerLost(RuntimeError):
    """The trainer rank's process is gone: the controller restarts it from the last checkpoint."""


async def call(method: Any, *args: Any, **kwargs: Any) -> Any:
    """`await actor.method.remote(*args, **kwargs)`, cancelling the remote call when the caller is cancelled."""
    ref = method.remote(*args, **kwargs)
    try:
        return await ref
    except asyncio.CancelledError:
        ray.cancel(ref)
        raise


class RayEngineClient:
    """The `Engine` protocol over one engine actor (`roles.EngineService`)."""

    def __init__(self, engine_id: str, actor: Any):
        self.engine_id = engine_id
        self.actor = actor
        self._version = 0

    @property
    def weight_version(self) -> int:
        return self._version

    async def _call(self, name: str, *args: Any) -> Any:
        try:
            return await call(getattr(self.actor, name), *args)
        except ACTOR_GONE as err:
            raise EngineGoneError(f"engine {self.engine_id} is gone: {type(err).__name__}") from None

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        out: GenerateOutput = await self._call("generate", request)
        self._version = out.weight_version
        return out

    async def update_weights(self, weights: Any, version: int) -> None:
        self._version = await self._call("update_weights", weights, version)

    async def pause(self) -> None:
        """Engine actors load weights between their own batches (`EngineService.update_weights`)."""

    async def resume(self) -> None:
        """See `pause`."""

    async def connect(self) -> dict[str, Any]:
        info: dict[str, Any] = await self._call("ready")
        return info

    async def health(self) -> bool:
        try:
            return bool(await self._call("probe"))
        except EngineGoneError:
            return False

    async def close(self) -> None:
        """The controller owns engine actors; a worker's client closes nothing."""


class RemoteBackend(Forwarder):
    """The `TrainBackend` protocol over trainer rank 0's actor (`roles.TrainerRank.call`: `backends.forwarding`'s
    Ray transport); blocking, as the loop calls backends from a worker thread."""

    def __init__(self, actor: Any, version: int = 0, followers: list[Any] | None = None,
                 stall_s: float | None = None):
        """`followers`: the refs of the other ranks' `follow` calls, which end only when a rank is lost (a
        collective call would otherwise wait for the lost rank until its timeout). A call that has not answered
        within `stall_s` is a stuck trainer, lost like a dead one."""
        super().__init__(version)
        self.actor = actor
        self.followers = list(followers or [])
        self.stall_s = stall_s

    def _wait(self, ref: Any) -> Any:
        """`ref` once its call has answered; TrainerLost if a rank is lost or stuck meanwhile."""
        try:
            # answered is enough: fetching would copy every published state dict to this (the head's) node
            done, _ = ray.wait([ref, *self.followers], num_returns=1, timeout=self.stall_s, fetch_local=False)
            if not done:
                raise TrainerLost(f"the trainer rank did not answer for {self.stall_s:g} s "
                                  "(cluster.health.trainer_stall_s)")
            if done[0] != ref:
                ray.get(done[0])  # a follower's call ended: it raises, or it returned early
                raise TrainerLost("a follower trainer rank stopped following rank 0")
        except ACTOR_GONE as err:
            raise TrainerLost(f"a trainer rank's process is gone ({type(err).__name__})") from None
        return ref

    def _get(self, ref: Any) -> Any:
        try:
            return ray.get(self._wait(ref))
        except ACTOR_GONE as err:
            raise TrainerLost(f"a trainer rank's process is gone ({type(err).__name__})") from None

    def _send(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
        reply: tuple[Any, int] = self._get(self.actor.call.remote(method, args, kwargs))
        return reply

    def hf_state_dict_ref(self) -> Any:
        """The weights as an ObjectRef this process owns, without fetching them: engines load them straight
        from the object store (one copy crosses, and it outlives the trainer rank)."""
        return self._wait(self.actor.hf_state_dict.remote())
