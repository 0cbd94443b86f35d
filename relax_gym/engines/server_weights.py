"""`relax-gym serve`'s SGLang-native weight routes: updates from disk, from tensors and from the trainer's weights
update group, inside SGLang's weight-update session. What differs from SGLang, by necessity:

- `/update_weights_from_tensor` takes SGLang's `serialized_named_tensors` (tensors shared from a process on this
  host: CUDA IPC handles, or shared memory for CPU tensors; unpickled against an allowlist, see `tensor_ipc`), or
  `{"safetensors_b64": <base64 of a safetensors file>}` from anywhere.
- `/init_weights_update_group`, `/update_weights_from_distributed` and `/destroy_weights_update_group` take
  SGLang's bodies: the server joins the trainer's named group (`weight_group`: gloo on CPU, NCCL on GPU) as one
  rank, `rank_offset`; received tensors load through the same checked path as the other updates, between batches
  (generation goes on while they arrive).
- Both refuse `load_format` (flattened buckets) and `abort_all_requests=true`, and as in SGLang 0.5.21+ run only
  inside a weight-update session (`/begin_weight_update` ... `/end_weight_update`, which neither pause nor flush);
  outside one they are refused (400) with SGLang's message.
- An update with `flush_cache: true` (its default) is refused (400) while requests run, where SGLang before 0.5.22
  fails an assertion in its scheduler.
- `weight_version` is a string of the engine's integer version, as SGLang's is a string; here it only goes up (an
  update with an older version is refused). Updates are checked whole (names, shapes, dtypes, finite values)
  before they touch the model.
"""

from __future__ import annotations

import asyncio
import base64
import math
import socket
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load as load_safetensors

from relax_gym.engines import tensor_ipc
from relax_gym.engines.base import EngineError, RequestError
from relax_gym.engines.embedded import EmbeddedEngine
from relax_gym.engines.server_schemas import (
    BadRequest,
    BeginWeightUpdateIn,
    DestroyGroupIn,
    InitGroupIn,
    UpdateFromDiskIn,
    UpdateFromDistributedIn,
    UpdateFromTensorIn,
)
from relax_gym.engines.weight_group import WeightGroup, create_group, parse_dtype
from relax_gym.web.address import is_loopback

#: SGLang 0.5.21+'s rule, in its words: a tensor or distributed update runs inside a weight-update session
OUTSIDE_SESSION = "{route} must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
#: why an update that asks for a cache flush is refused while requests run
UNFLUSHABLE = ("flush_cache: requests are running, so the cache cannot be flushed after the update (SGLang before "
               "0.5.22 fails an assertion in its scheduler here, later ones fail the update): pause in abort mode "
               "and flush first, or send flush_cache: false")


def _refused(message: str) -> JSONResponse:
    """SGLang's answer to a weight route that did not succeed."""
    return JSONResponse({"success": False, "message": message}, status_code=400)


def _version(value: int | str | None, current: int) -> int:
    """The update's integer version: given, or one past `current`; never below `current`."""
    if value is None:
        return current + 1
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"weight_version: expected a non-negative integer (or a string of one), got {value!r}")
    if value < current:
        raise BadRequest(f"weight_version: {value} is older than the served weights' {current}; versions only go "
                         "up (restart the server to serve older weights)")
    return value


async def _dialable(address: str, client: str | None) -> bool:
    """Whether `address` resolves to loopback only, or to the asking client's own host."""
    try:
        found = await asyncio.get_running_loop().getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    hosts = {str(info[4][0]) for info in found}
    return bool(hosts) and all(is_loopback(h) or h == client for h in hosts)


def weight_routes(engine: EmbeddedEngine) -> APIRouter:
    """The weight routes over `engine`, with their state: the session, and the weights update groups by name, as
    SGLang keeps them."""
    router = APIRouter()
    groups: dict[str, WeightGroup] = {}
    joining: set[str] = set()  # names whose /init_weights_update_group is waiting for the other ranks
    session = {"open": False}  # SGLang 0.5.21+'s weight-update session: tensor and distributed updates need one
    model_numel = sum(t.numel() for t in engine.model.state_dict().values())

    @router.post("/update_weights_from_disk")
    async def update_from_disk(body: UpdateFromDiskIn) -> JSONResponse:
        return await _update(body.model_path, body.weight_version, body.flush_cache)

    @router.post("/begin_weight_update")
    async def begin_weight_update(body: BeginWeightUpdateIn) -> JSONResponse:
        """Opens the session, as SGLang 0.5.21+ does; it neither pauses nor flushes (pause first for that)."""
        if session["open"]:
            return _refused(SESSION_OPEN)
        session["open"] = True
        return JSONResponse({"success": True, "message": "Weight update session started."})

    @router.post("/end_weight_update")
    async def end_weight_update() -> JSONResponse:
        if not session["open"]:
            return _refused(NO_SESSION)
        session["open"] = False
        return JSONResponse({"success": True, "message": "Weight update session ended."})

    def _outside_session(route: str) -> JSONResponse | None:
        """SGLang 0.5.21+'s refusal of a tensor or distributed update outside a session, else None."""
        return None if session["open"] else _refused(OUTSIDE_SESSION.format(route=route))

    @router.post("/update_weights_from_tensor")
    async def update_from_tensor(body: UpdateFromTensorIn) -> JSONResponse:
        if (refusal := _outside_session("update_weights_from_tensor")) is not None:
            return refusal
        if body.serialized_named_tensors is not None:
            try:  # the sender's memory: `_update` copies it into the model before answering
                tensors = await asyncio.to_thread(tensor_ipc.load, body.serialized_named_tensors[0])
            except ValueError as err:
                raise BadRequest(f"serialized_named_tensors: {err}") from None
            return await _update(tensors, body.weight_version, body.flush_cache)
        assert body.safetensors_b64 is not None  # UpdateFromTensorIn's validator: exactly one payload
        try:
            tensors = load_safetensors(base64.b64decode(body.safetensors_b64, validate=True))
        except Exception as err:
            raise BadRequest(f"safetensors_b64: not base64 of a safetensors file: {err}") from err
        return await _update(tensors, body.weight_version, body.flush_cache)

    async def _update(weights: Any, version: int | str | None, flush_cache: bool) -> JSONResponse:
        if flush_cache and engine.busy:  # SGLang flushes after the update and cannot while requests run
            return _refused(UNFLUSHABLE)
        try:
            await engine.update_weights(weights, _version(version, engine.weight_version))
        except (RequestError, BadRequest) as err:
            return _refused(str(err))
        message = f"Succeeded to update model weights (weight_version {engine.weight_version})."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    @router.post("/init_weights_update_group")
    async def init_group(body: InitGroupIn, request: Request) -> JSONResponse:
        """Blocks until the trainer (rank 0) and every other rank have joined, or the group's timeout. The group's
        store is dialled only on this machine or on the host that asked: the key does not make the server a
        client of any address a caller names."""
        name = body.group_name
        if not await _dialable(body.master_address, request.client.host if request.client else None):
            return _refused(f"master_address: {body.master_address!r} is neither this machine nor the client that "
                            "asks (the trainer rank hosts the group's store)")
        if name in groups or name in joining:
            return _refused(f"group_name: a group named {name!r} exists; destroy it first")
        if body.backend == "nccl" and engine.device.type != "cuda":
            return _refused(f"backend: 'nccl' needs the model on a CUDA device, it is on {engine.device}; use 'gloo'")
        joining.add(name)
        try:
            groups[name] = await asyncio.to_thread(
                create_group, body.master_address, body.master_port, body.rank_offset, body.world_size, name,
                body.backend,
            )
        except Exception as err:  # a bad backend, an unreachable master, the group's timeout
            return _refused(f"Failed to join weights update group {name!r}: {err}")
        finally:
            joining.discard(name)
        return JSONResponse({"success": True, "message": f"Joined weights update group {name!r} as rank "
                                                         f"{body.rank_offset} of {body.world_size}."})

    @router.post("/update_weights_from_distributed")
    async def update_from_distributed(body: UpdateFromDistributedIn) -> JSONResponse:
        """Receives every tensor, then loads them as /update_weights_from_tensor does: a refusal after receiving
        (a name, shape or version the model does not take) leaves the group in step for the next update.

        What is refused before receiving leaves the trainer's broadcast unanswered: destroy the group then."""
        if (refusal := _outside_session("update_weights_from_distributed")) is not None:
            return refusal
        group = _group(body.group_name)
        try:
            dtypes = [parse_dtype(name) for name in body.dtypes]
        except ValueError as err:
            raise BadRequest(f"dtypes: {err}") from None
        if (numel := sum(math.prod(shape) for shape in body.shapes)) > model_numel:
            raise BadRequest(f"shapes: {numel} elements in all, more than the model's {model_numel}")
        device = torch.device("cpu") if group.backend == "gloo" else engine.device
        try:
            tensors = await asyncio.to_thread(group.receive, list(zip(body.shapes, dtypes, strict=True)), device)
        except Exception as err:  # the trainer went away, or the group's timeout
            raise EngineError(f"receiving from group {body.group_name!r} failed ({err}); no weights were changed. "
                              "Destroy the group and make it again.") from err
        return await _update(dict(zip(body.names, tensors, strict=True)), body.weight_version, body.flush_cache)

    @router.post("/destroy_weights_update_group")
    async def destroy_group(body: DestroyGroupIn) -> JSONResponse:
        group = _group(body.group_name)
        del groups[body.group_name]
        await asyncio.to_thread(group.destroy)
        return JSONResponse({"success": True, "message": f"Destroyed weights update group {body.group_name!r}."})

    def _group(name: str) -> WeightGroup:
        if name not in groups:
            known = ", ".join(repr(n) for n in groups) or "none"
            raise BadRequest(f"group_name: no weights update group named {name!r} (groups: {known}); "
                             "make it with /init_weights_update_group")
        return groups[name]

    return router
