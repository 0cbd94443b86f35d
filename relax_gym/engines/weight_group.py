"""A named torch.distributed group between a trainer (rank 0) and inference servers, to broadcast weights.

Built from torch's store and backend classes, not `init_process_group` / `new_group`: those hang every group off
the process-global default group (and refuse a second group of the same name in one process), which a server
that many trainers talk to over time, or a test holding both sides, cannot use. The store keys are laid out as
torch's `_new_process_group_helper` lays them (TCPStore, then prefixes "{name}", "{name}/" and "{device}/"),
which is what SGLang's and slime's `init_custom_process_group` build on, so a group made here joins one made
there: this trainer can publish to a real SGLang server, and `relax-gym serve` can receive from slime.

Gloo connects every pair of ranks while the group is made (so every rank must be joining at once); NCCL
connects at the first broadcast, as theirs do (a side that connected eagerly would wait on a lazy one forever).
Broadcasts of one group go one sequence at a time (a lock); `destroy` does not wait for them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: how long making the group, and each broadcast, may wait for the other ranks
DEFAULT_TIMEOUT_S = 600.0
BACKENDS = ("gloo", "nccl")


def parse_dtype(name: str) -> torch.dtype:
    """A dtype from its name as SGLang and slime send it ("bfloat16"), or as `str(dtype)` writes it."""
    dtype = getattr(torch, name.removeprefix("torch."), None) if name.strip() == name else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype (e.g. 'float32', 'bfloat16', 'torch.float16')")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang's receiver reads back with `getattr(torch, name)`: "bfloat16", no "torch." prefix."""
    return str(dtype).removeprefix("torch.")


def open_store(
    master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dist.TCPStore:
    """The group's rendezvous store. Rank 0 hosts it and returns at once (`master_port=0` picks a free port: read
    it from `.port`); the other ranks connect to it, waiting up to `timeout_s` for it to be there."""
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        # multi_tenant as torch's tcp:// rendezvous makes it; no waiting for workers, so the port is known first
        return dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=False, multi_tenant=True)
    return dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)


@dataclass(eq=False)
class WeightGroup:
    """This process's rank in one named group; rank 0 sends, every other rank receives."""

    name: str
    rank: int
    world_size: int
    backend: str
    _store: dist.Store | None = field(repr=False)
    _pg: Any = field(repr=False)  # a c10d Backend (ProcessGroupGloo / ProcessGroupNCCL)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _destroyed: bool = False

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0: broadcasts `tensors` in order (contiguous; CUDA ones for NCCL); returns once all are sent."""
        if self.rank != 0:
            raise ValueError(f"group {self.name!r}: only rank 0 sends, this is rank {self.rank}")
        if not all(t.is_contiguous() for t in tensors):
            raise ValueError(f"group {self.name!r}: broadcast tensors must be contiguous")
        self._broadcast(list(tensors))

    def receive(
        self, specs: Sequence[tuple[Sequence[int], torch.dtype]], device: torch.device | str
    ) -> list[torch.Tensor]:
        """Another rank: allocates one tensor per (shape, dtype) on `device` and receives rank 0's broadcasts
        into them, in order."""
        if self.rank == 0:
            raise ValueError(f"group {self.name!r}: rank 0 sends, it does not receive")
        tensors = [torch.empty(tuple(shape), dtype=dtype, device=device) for shape, dtype in specs]
        self._broadcast(tensors)
        return tensors

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        # All issued, then all awaited, as SGLang's receiver does: the order of issue is the order of matching.
        options = dist.BroadcastOptions()
        options.rootRank = 0
        with self._lock:
            if self._destroyed:
                raise RuntimeError(f"group {self.name!r} was destroyed")
            works = [self._pg.broadcast([t], options) for t in tensors]
            for work in works:
                work.wait()

    def destroy(self) -> None:
        """Frees the group's connections (and, on rank 0, its store). A broadcast in flight is not waited for:
        it fails, or ends at the group's timeout. Idempotent."""
        if self._destroyed:
            return
        self._destroyed = True
        self._pg.shutdown()
        self._pg = self._store = None


def join_group(
    store: dist.Store, rank: int, world_size: int, name: str, backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> WeightGroup:
    """This process as `rank` of the group `name` over `store` (from `open_store`). With gloo it returns once all
    `world_size` ranks have joined (so run it beside the other ranks' joins, e.g. in a thread), or raises after
    `timeout_s`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    timeout = timedelta(seconds=timeout_s)
    # The key prefixes of torch's _new_process_group_helper under SGLang's init_custom_process_group (see above).
    group_store = dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store))
    pg: Any
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", group_store), rank, world_size, timeout=timeout)
    else:
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None or not dist.is_nccl_available() or not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA and a torch built with NCCL; use 'gloo' on CPU")
        options = nccl.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.group_name = name
        pg = nccl(dist.PrefixStore("cuda/", group_store), rank, world_size, options)
    pg._set_sequence_number_for_group()  # as the helper does: rank 0 sets it in the store, the others read it
    return WeightGroup(name, rank, world_size, backend, store, pg)


def create_group(
    master_address: str, master_port: int, rank: int, world_size: int, name: str, backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> WeightGroup:
    """`open_store` then `join_group`: how a receiving rank joins the group whose store rank 0 hosts."""
    return join_group(open_store(master_address, master_port, rank, world_size, timeout_s), rank, world_size, name,
                      backend, timeout_s)
