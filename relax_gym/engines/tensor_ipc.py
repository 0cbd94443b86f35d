"""SGLang's `serialized_named_tensors`: a state dict handed to a server on the same host without copying it
through the request body or the disk.

The payload is SGLang's own (`UpdateWeightsFromTensorReqInput`): one base64 string per tensor-parallel rank,
each a `multiprocessing.reduction.ForkingPickler` pickle of `[(name, tensor), ...]`. Pickled that way a CUDA
tensor travels as a CUDA IPC handle (the server maps the trainer's memory), and a CPU tensor as the name of a
shared-memory segment (torch's "file_system" sharing, forced here for this pickle only: the default
"file_descriptor" sharing passes descriptors through a socket that only a child process may open). Either
way the tensors are the sender's memory, so they must stay alive until the server has answered.

The tensors are first packed as views into one byte buffer per device (`pack`), so a model of hundreds of
tensors costs one IPC handle or one shared-memory segment, not hundreds (slime's flattened buckets do the
same for SGLang).

The receiving side (`relax-gym serve`) unpickles with an allowlist (`load`): only torch's rebuild functions for
shared tensors, storages, dtypes and sizes, and shared-memory names of the form torch itself gives, so a
request body cannot name any other callable (SGLang guards its `SafeUnpickler` the same way).
"""

from __future__ import annotations

import base64
import io
import pickle
import re
from collections.abc import Iterable, Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing import reductions

#: byte alignment of each tensor in a packed buffer: a multiple of every dtype's element size
ALIGN = 16
#: the shared-memory names torch's file_system sharing gives (`/torch_<pid>_<random>_<counter>`), and the socket
#: of the `torch_shm_manager` that holds them (`<tmp>/torch-shm-dir-<random>/manager.sock`)
_SHM_NAME = re.compile(rb"/torch_\d+_\d+_\d+")
_SHM_MANAGER = re.compile(rb"/[^\0]*/torch-shm-dir-\w+/manager\.sock")


def pack(weights: Mapping[str, torch.Tensor],
         into: list[tuple[str, torch.Tensor]] | None = None) -> list[tuple[str, torch.Tensor]]:
    """`weights` as views into one new byte buffer per device (on the CPU, made in shared memory), in order; a
    copy, so the caller's tensors are never moved into shared memory.

    `into`, an earlier `pack` of the same names, shapes, dtypes and devices, is filled again instead: a new
    shared-memory segment costs a page fault per page on its first write, about as much as the copy itself. Only
    while the server that read it last is done with it (it has answered)."""
    if into is not None and _layout(into) == _layout(weights.items()):
        for (_, view), tensor in zip(into, weights.values(), strict=True):
            view.copy_(tensor.detach())
        return into
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in weights.items():
        by_device.setdefault(tensor.device, []).append((name, tensor.detach()))
    views: dict[str, torch.Tensor] = {}
    for device, named in by_device.items():
        offsets, size = [], 0
        for _, tensor in named:
            offsets.append(size)
            size += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        buffer = _shared_buffer(size) if device.type == "cpu" else torch.empty(size, dtype=torch.uint8, device=device)
        for (name, tensor), start in zip(named, offsets, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            view = buffer[start:start + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            views[name] = view
    return [(name, views[name]) for name in weights]


def _layout(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Size, torch.dtype, torch.device]]:
    return [(name, t.shape, t.dtype, t.device) for name, t in named]


def _shared_buffer(size: int) -> torch.Tensor:
    """`size` bytes made in shared memory by name, so sharing them later copies nothing."""
    storage = torch.UntypedStorage._new_using_filename_cpu(size)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def serialize(named: list[tuple[str, torch.Tensor]], tp_size: int = 1) -> list[str]:
    """SGLang's `serialized_named_tensors` for `named` (one entry per rank of a `tp_size` server: each rank
    takes the whole tensors and keeps its shard)."""
    buffer = io.BytesIO()
    _SharingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(named)
    return [base64.b64encode(buffer.getvalue()).decode()] * tp_size


class _SharingPickler(ForkingPickler):
    """ForkingPickler whose CPU storages go by shared-memory name, as under torch's file_system strategy."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.UntypedStorage) and obj.device.type == "cpu" and obj.nbytes():
            manager, handle, size = obj._share_filename_cpu_()
            obj._shared_incref()  # the receiver's rebuild drops this reference
            reductions.shared_cache[handle] = reductions.StorageWeakRef(obj)
            return reductions.rebuild_storage_filename, (type(obj), manager, handle, size)
        return NotImplemented


def _rebuild_shared_cpu(cls: type, manager: bytes, handle: bytes, size: int, dtype: Any = None) -> Any:
    if not isinstance(handle, bytes) or not _SHM_NAME.fullmatch(handle):
        raise pickle.UnpicklingError(f"shared memory {handle!r} is not a segment torch shares")
    if not isinstance(manager, bytes) or not _SHM_MANAGER.fullmatch(manager):
        raise pickle.UnpicklingError(f"{manager!r} is not the socket of torch's shared-memory manager")
    return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)


_TORCH_TYPES = {"Tensor", "Size", "device", "UntypedStorage"} | {
    name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)
} | {cls.__name__ for cls in torch._storage_classes}
_REBUILDS = {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
             "rebuild_storage_empty"}


class _AllowlistUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _TORCH_TYPES:
            return getattr(torch, name)
        if (module, name) in {("torch.storage", "TypedStorage"), ("torch.storage", "UntypedStorage")}:
            return getattr(torch.storage, name)
        if (module, name) == ("torch.nn.parameter", "Parameter"):
            return torch.nn.Parameter
        if module == "torch.multiprocessing.reductions":
            if name in _REBUILDS:
                return getattr(reductions, name)
            if name == "rebuild_storage_filename":
                return _rebuild_shared_cpu
            if name == "rebuild_storage_fd":
                raise pickle.UnpicklingError(
                    "CPU tensors were shared by file descriptor, which only a child process can receive: "
                    "share them by name (torch's file_system strategy, as relax_gym.engines.tensor_ipc does)")
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in serialized_named_tensors")


def load(entry: str) -> dict[str, torch.Tensor]:
    """One rank's entry of `serialized_named_tensors` as {name: tensor}; `ValueError` naming what is wrong.

    The tensors are the sender's memory: copy them before the sender may free it (after answering)."""
    try:
        named = _AllowlistUnpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()
    except Exception as err:  # a bad base64, a refused global, a segment or device that cannot be opened here
        raise ValueError(f"not a pickle of shared named tensors that this server can open: {err}") from err
    if not (isinstance(named, list) and all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in named)):
        raise ValueError("not a list of (name, tensor) pairs")
    return dict(named)
