"""Running megatron-core on a machine without CUDA: every CPU workaround of the backend lives here.

megatron-core (0.16) assumes a GPU in a handful of places that are not about
computation at all: it allocates buffers with `device="cuda"` or
`device=torch.cuda.current_device()`, moves modules with `.cuda()`, asserts
that parameters report a `torch.cuda.*` type before building an optimizer,
calls `torch.cuda.synchronize()` around pipeline communication, and keeps its
dropout RNG streams as CUDA generator states. On a CPU-only torch each of those
raises, although the maths underneath runs on CPU tensors unchanged.

`cuda_on_cpu()` makes those calls land on the CPU, and only while megatron code
runs: the backend enters it around each of its public methods. It is a no-op
where CUDA is available, so the GPU path is megatron's own, untouched.

- Process-wide and idempotent (`enable()`): `torch.cuda.current_device()`
  returns the CPU device and `torch.cuda.synchronize()` does nothing (both
  would raise on a CPU build, so nothing that works is changed), and megatron's
  RNG tracker is the inference tracker, whose `fork()` is a no-op: there are no
  CUDA generator states to fork. Consequence: dropout inside tensor-parallel
  regions is not coordinated across TP ranks on CPU (the Qwen models use no
  dropout, so training is unaffected). The MoE all-to-all token dispatcher copies
  its split sizes to the host on a side CUDA stream: `torch.cuda.Stream`,
  `current_stream` and `stream` become one host stand-in (`_HostStream`), on
  which every copy is already done; and its split sizes become the numpy arrays
  its device-to-host copy makes of them on a GPU (left as tensors on a CPU, they
  fail torch's all-to-all, in the backward pass too, where no mode reaches).
- Per thread, only inside the context: a `TorchFunctionMode` that rewrites
  `device="cuda"` arguments and `.cuda()` / `.to("cuda")` to the CPU and makes
  `Tensor.type()` report the `torch.cuda.*` name megatron's optimizers assert.
  A mode is thread-local, which is why it is entered per call (the train loop
  runs the backend in a worker thread) rather than once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any, ParamSpec, TypeVar

import torch
from torch.overrides import TorchFunctionMode

P = ParamSpec("P")
R = TypeVar("R")

_CPU = torch.device("cpu")
_lock = threading.Lock()
_enabled = False
_active = threading.local()  # per-thread depth of cuda_on_cpu(), so nested calls push the mode once


def needed() -> bool:
    """True where the layer does anything: this torch has no usable CUDA device."""
    return not torch.cuda.is_available()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpuMode(TorchFunctionMode):
    """Routes megatron's CUDA-only tensor placements to the CPU (see the module docstring)."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and kwargs.get("dtype") is None:
            return func(*args, **kwargs).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _HostStream:
    """One CPU "stream" standing for every CUDA stream: work on it is done when issued, so waiting and events are
    no-ops (a singleton, so megatron sees the current stream and its side stream as the same one)."""

    _one: _HostStream | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> _HostStream:
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _HostStream:
        return self

    def synchronize(self) -> None:
        pass


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's `maybe_move_tensor_to_cpu` as it ends on a GPU: a tensor already on the host becomes the numpy
    array the GPU path's copy gives when `as_numpy`."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.cpu().numpy()
    return tensor


def _host_stream_context(stream: Any = None) -> contextlib.nullcontext[None]:
    """`torch.cuda.stream(s)`: work on the host stand-in needs no switch."""
    return contextlib.nullcontext()


def enable() -> None:
    """Process-wide part of the layer; idempotent, and a no-op where CUDA is available."""
    global _enabled
    if not needed():
        return
    with _lock:
        if _enabled:
            return
        from megatron.core.tensor_parallel import random as mcore_random
        from megatron.core.transformer.moe import token_dispatcher

        torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment, return-value]  # a device, on purpose
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.Stream = _HostStream  # type: ignore[misc, assignment]  # the stand-in, on purpose
        torch.cuda.current_stream = lambda device=None: _HostStream()  # type: ignore[assignment, return-value]
        torch.cuda.stream = _host_stream_context  # type: ignore[assignment]  # the stand-in, on purpose
        token_dispatcher.maybe_move_tensor_to_cpu = _to_host
        mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        _enabled = True


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Run megatron code on the CPU: `enable()` plus the cuda→cpu function mode on this thread."""
    if not needed():
        yield
        return
    enable()
    depth = getattr(_active, "depth", 0)
    _active.depth = depth + 1
    try:
        if depth:
            yield
        else:
            with _CudaToCpuMode():
                yield
    finally:
        _active.depth = depth


def on_cpu(method: Callable[P, R]) -> Callable[P, R]:
    """Decorator form of `cuda_on_cpu()`, for the backend's public methods."""

    @wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with cuda_on_cpu():
            return method(*args, **kwargs)

    return wrapper
