"""Publishing trained weights to inference servers by torch.distributed broadcast, driven over SGLang's routes.

The trainer is rank 0 of a named group; each server joins it as one more rank (`/init_weights_update_group`).
Each publication posts `/update_weights_from_distributed` (names, dtypes, shapes, version) to every server
first, then broadcasts the tensors in that order, then awaits the answers: the order slime uses, so the
same code drives real SGLang servers (NCCL) and `relax-gym serve` (gloo on CPU). The weights cross the
group once for all servers, instead of a file or an HTTP body per server.

Use, in the train loop (pause / resume around it as for any weight update)::

    publisher = DistributedPublisher(engines, backend="nccl", master_address=trainer_host)
    await publisher.connect()
    ...
    await publisher.publish(backend.hf_state_dict(), step)
    ...
    await publisher.close()

A group's members are fixed when it is made. When servers come or go, `close()` then `connect(new_engines)`.
A failed `publish` leaves the group out of step (a broadcast no one receives ends only at `timeout_s`): do
the same then. After a failed `connect`, the servers that were waiting keep the group's name until
`timeout_s`: connect again under another `group_name` to retry sooner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

import torch

from relax_gym.engines.base import EngineError
from relax_gym.engines.sglang import SGLangEngine
from relax_gym.engines.weight_group import DEFAULT_TIMEOUT_S, WeightGroup, join_group, open_store

#: how NCCL refuses, at a group's first broadcast, two ranks on one GPU (NCCL 2.28 on an H100: the trainer and a
#: `relax-gym serve` sharing the GPU), among other misuses
NCCL_INVALID_USAGE = "invalid usage"
ONE_GPU_EACH = ("NCCL refuses two ranks of a group on one GPU, as a trainer and a server sharing a GPU are: give "
                "each its own GPU, or sync through CUDA IPC (an engine server on this host, weight_sync: tensor), "
                "the object store or the disk")


class DistributedPublisher:
    """Rank 0 of the weights group `group_name` whose other ranks are `engines` (rank 1 + their index)."""

    def __init__(
        self,
        engines: Sequence[SGLangEngine],
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        group_name: str = "relax-gym-weights",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        """`master_address` is this host as the servers reach it (the group's store listens on every
        interface, on a free port); `timeout_s` bounds forming the group and each broadcast."""
        self.engines = list(engines)
        self.backend = backend
        self.master_address = master_address
        self.group_name = group_name
        self.timeout_s = timeout_s
        self._group: WeightGroup | None = None
        self._broken: str | None = None

    @property
    def connected(self) -> bool:
        return self._group is not None

    async def connect(self, engines: Sequence[SGLangEngine] | None = None) -> None:
        """Forms the group with `engines` (default: the current ones): this side in a thread, while every
        server's /init_weights_update_group call waits for the others. Raises an EngineError naming the first
        server that could not join."""
        if self._group is not None:
            raise EngineError(f"weights group {self.group_name!r} is connected: close() it first")
        if engines is not None:
            self.engines = list(engines)
        if not self.engines:
            raise EngineError("a weights group needs at least one server")
        world_size = 1 + len(self.engines)
        try:
            store = open_store(self.master_address, 0, 0, world_size, self.timeout_s)
        except RuntimeError as err:  # torch's DistNetworkError / DistStoreError
            raise EngineError(f"this trainer could not host the weights group's store: {err}") from err
        port = store.port
        local = asyncio.to_thread(join_group, store, 0, world_size, self.group_name, self.backend, self.timeout_s)
        joins = [
            e.init_weights_update_group(self.master_address, port, 1 + i, world_size, self.group_name, self.backend)
            for i, e in enumerate(self.engines)
        ]
        results = await self._first_failure(local, joins, "could not join")
        self._group, self._broken = results[0], None

    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Every server loads `state_dict` as `version` (dtypes kept; the tensors are sent contiguous, from the
        CPU over gloo and from this GPU over NCCL). Returns once all have; raises an EngineError naming the first
        server that failed."""
        group = self._require_group()
        names = list(state_dict)
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        tensors = [t.detach().to(device).contiguous() for t in state_dict.values()]
        dtypes = [t.dtype for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        # The servers' requests go out first, then the broadcast (in a thread: it blocks until all received).
        updates = [e.update_weights_from_distributed(names, dtypes, shapes, self.group_name, version)
                   for e in self.engines]
        try:
            await self._first_failure(asyncio.to_thread(group.send, tensors), updates, "failed to send")
        except EngineError as err:
            self._broken = str(err)
            if self.backend == "nccl" and NCCL_INVALID_USAGE in str(err):
                raise EngineError(f"{err}. {ONE_GPU_EACH}") from err
            raise

    async def close(self) -> None:
        """Destroys the group on every server, then here. Servers that cannot be reached are skipped (their
        side goes when they restart); this side is always destroyed."""
        group, self._group = self._group, None
        if group is None:
            return
        try:
            await asyncio.gather(*(e.destroy_weights_update_group(self.group_name) for e in self.engines),
                                 return_exceptions=True)
        finally:
            await asyncio.to_thread(group.destroy)

    def _require_group(self) -> WeightGroup:
        if self._group is None:
            raise EngineError(f"weights group {self.group_name!r} is not connected: call connect() first")
        if self._broken is not None:
            raise EngineError(f"weights group {self.group_name!r} is out of step after a failed publish "
                              f"({self._broken}): close() and connect() again")
        return self._group

    async def _first_failure(self, local: Awaitable[Any], calls: Sequence[Awaitable[None]], what: str) -> list[Any]:
        """Runs this side and every server's call at once; returns their results, or raises at the first failure
        (the others would wait for the failed one until the timeout) an EngineError naming who failed: `what`
        says what this side failed to do."""
        tasks = [asyncio.ensure_future(local), *(asyncio.ensure_future(c) for c in calls)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for i, task in enumerate(tasks):
                if task in done and (err := task.exception()) is not None:
                    # the clients' errors name their server already
                    cause = f"this trainer (rank 0) {what}: {err}" if i == 0 else str(err)
                    raise EngineError(f"weights group {self.group_name!r}: {cause}") from err
            return [task.result() for task in tasks]
        finally:
            for task in tasks[1:]:
                task.cancel()  # the HTTP calls (this side's thread cannot be cancelled: it ends at the timeout)
            # ...and waited for, so each has closed its server's weight-update session before this returns
            await asyncio.gather(*tasks[1:], return_exceptions=True)
            tasks[0].add_done_callback(lambda t: t.cancelled() or t.exception())  # its error is reported above
