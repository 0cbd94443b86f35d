"""The `Engine` protocol over SGLang's native HTTP API, and a launcher for a real SGLang server.

The client speaks to `python -m sglang.launch_server` at scale and to
`relax-gym serve` (the embedded engine behind the same routes) anywhere else.
Images travel as base64 PNG data URLs, audio as base64 float WAV (lossless, so
both servers see the exact pixels and samples); `mm_inputs` cannot travel, the
server recomputes them from the media.

Outages, errors and the connection pool are `http_engine.HTTPEngine`'s. `connect()` resumes a server left
paused by a trainer that was killed between `pause()` and `resume()`.

A weight update pauses as slime does: `pause()` sends mode "abort" (running
requests end at once with the tokens they have, queued ones with none) and
retries `/flush_cache` until the server is idle; the update then asks for no
flush of its own (SGLang before 0.5.22 asserts when one fails). `generate` sends
a request that a pause aborted on again, as its prompt plus its tokens so far,
which waits for `resume()`; each token keeps the version it came from
(`GenerateOutput.token_versions`, also read from SGLang's per-answer version
spans). A state dict goes to a server on this host as SGLang's
`serialized_named_tensors` (`tensor_ipc`: CUDA IPC handles or shared memory,
nothing copied through the body or the disk); to `relax-gym serve` elsewhere as
base64 safetensors, which SGLang does not read (there a folder path or the
distributed routes are needed). A non-integer `weight_version` (SGLang's
initial one is "default") leaves `weight_version` at the last
integer this client set. Seeds are sent in 31 bits, and `connect()` warns when
the server ignores them (SGLang without `--enable-deterministic-inference`).
The distributed routes (`init_weights_update_group` and the rest) send SGLang's own
bodies, so `relax_gym.trainer.weight_publish` drives either server the same way.

SGLang 0.5.21+ (and `relax-gym serve`) load tensor and distributed updates only inside a
weight-update session: the client opens one (`/begin_weight_update`) around each such update
and closes it (`/end_weight_update`) whether the update succeeded or not; a session left open by
a killed trainer is closed and opened again, with a warning. Older releases get no session.
The server's release is read from `/server_info` (`/get_server_info` before SGLang named it so),
the live weight version from `/model_info` (`/get_model_info`): `/server_info` reports launch
arguments, whose `weight_version` never changes. A release older than `MIN_SGLANG` is refused
at `connect()`.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import soundfile
import torch
from PIL import Image
from safetensors.torch import save

from relax_gym.engines import tensor_ipc
from relax_gym.engines.base import (
    EngineError,
    GenerateOutput,
    GenerateRequest,
    RequestError,
)
from relax_gym.engines.http_engine import (
    OUTAGE_TIMEOUT_S,
    HTTPEngine,
    ServerProcess,
    span_versions,
    start_server,
    version_number,
)
from relax_gym.engines.pushed_adapters import KEEP_ADAPTERS, PushedAdapters
from relax_gym.engines.weight_group import dtype_name
from relax_gym.models.lora import ADAPTER_CONFIG
from relax_gym.video import Video, lossless_bytes
from relax_gym.web.address import is_loopback
from relax_gym.web.client import backoff_delay

logger = logging.getLogger("relax_gym.engines")

#: SGLang's finish_reason messages for requests that an abort-mode pause ended, running and queued: the client
#: sends the rest of such a request again, which waits for the pause to end
PAUSE_ABORTED = "Aborted"
PAUSE_ABORTED_QUEUED = "Abort in waiting queue"
#: how `relax-gym serve`'s /get_server_info names its backend
SERVE_BACKEND = "relax_gym embedded"
#: times one request is resumed after pauses before the client gives up on it
MAX_RESUMES = 16
#: seconds `pause` retries /flush_cache, which SGLang refuses while aborted requests are still winding down
FLUSH_TIMEOUT_S = 60.0
#: how one launches an SGLang server that loads a run's adapters at runtime
LORA_HINT = ("launch SGLang with --enable-lora --max-lora-rank R (R >= trainer.lora.rank) --lora-target-modules all "
             "--max-loras-per-batch K --max-loaded-loras K+1 (K >= trainer.max_staleness + 1), as `lora_args` "
             "writes them; relax-gym serve loads adapters as it is")
#: the oldest SGLang release the client drives (its `sampling_seed` in an int32, abort-mode pauses, `rid`s)
MIN_SGLANG = (0, 5, 6)
#: the first SGLang release that loads tensor and distributed updates only inside a weight-update session
SESSIONS_SINCE = (0, 5, 21)


def video_data_url(video: Video) -> str:
    """A clip as SGLang's `video_data` takes it: a data URL of its sampled frames, lossless, at its rate
    (`relax_gym.video.lossless_bytes`). `relax-gym serve` uses every frame; SGLang samples again by its own rate
    and frame count, and a prompt that comes out another length is refused (`prompt_tokens`)."""
    return "data:video/x-matroska;base64," + base64.b64encode(lossless_bytes(video)).decode()


def png_data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def wav_data_url(wave: np.ndarray, rate: int) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.asarray(wave, dtype=np.float32), rate, format="WAV", subtype="FLOAT")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


def release(version: Any) -> tuple[int, ...] | None:
    """SGLang's `version` string as numbers ("0.5.23" -> (0, 5, 23); "0.5.12.post1" -> (0, 5, 12)); None for
    anything else (`relax-gym serve` reports relax_gym's own version and its `backend`)."""
    parts = str(version or "").split(".")
    numbers = [int(p) for p in parts[:3] if p.isdigit()]
    return tuple(numbers) if len(numbers) == 3 else None


def _paused_abort(body: dict[str, Any]) -> bool:
    """Whether an answer is a request that a pause aborted (SGLang's abort_all), not one refused or timed out."""
    finish = (body.get("meta_info") or {}).get("finish_reason") or {}
    return (finish.get("type") == "abort" and finish.get("status_code") is None
            and finish.get("message") in (PAUSE_ABORTED, PAUSE_ABORTED_QUEUED))


class SGLangEngine(HTTPEngine):
    """An httpx client of one SGLang(-compatible) server at `base_url`."""

    #: a pickled copy (a rollout worker's) knows the adapters the server holds, so its requests name the newest
    _carried = ("adapters",)

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        outage_timeout_s: float = OUTAGE_TIMEOUT_S,
        backoff_s: float = 0.5,
        max_backoff_s: float = 5.0,
        retries: int | None = None,
        max_connections: int | None = None,
        api_key: str | None = None,
        flush_timeout_s: float = FLUSH_TIMEOUT_S,
        share_tensors: bool | None = None,
        keep_adapters: int = KEEP_ADAPTERS,
    ) -> None:
        """The connection's settings are `HTTPEngine`'s. `flush_timeout_s` bounds how long `pause` waits for the
        server to be idle. `share_tensors` (default: whether `base_url` is loopback) sends state dicts as tensors
        shared on this host (`tensor_ipc`); False for a server on this host that cannot map this process's memory
        (another container's shared memory, another GPU context). `keep_adapters`: how many pushed LoRA adapters
        stay loaded (the newest)."""
        super().__init__(base_url, timeout_s=timeout_s, outage_timeout_s=outage_timeout_s, backoff_s=backoff_s,
                         max_backoff_s=max_backoff_s, retries=retries, max_connections=max_connections,
                         api_key=api_key, flush_timeout_s=flush_timeout_s, share_tensors=share_tensors)
        self.flush_timeout_s = flush_timeout_s
        self.share_tensors = is_loopback(httpx.URL(self.base_url).host) if share_tensors is None else share_tensors
        self._shared: list[tuple[str, torch.Tensor]] | None = None  # the last state dict shared, in shared memory
        self._info: dict[str, Any] | None = None  # `_server_info`'s
        #: the pushed adapters loaded, oldest first; a request naming none runs on the newest
        self.adapters = PushedAdapters(keep_adapters)

    async def connect(self) -> dict[str, Any]:
        """Waits (up to `outage_timeout_s`) for the server, resumes generation and returns /model_info, whose
        `weight_version` the client takes as the server's (a numeric one; SGLang starts at "default").

        A trainer killed between `pause()` and `resume()` leaves the server paused, and every later /generate
        would wait forever. /continue_generation goes first: SGLang's /health generates a token, so it cannot
        answer 200 while paused. An SGLang release older than `MIN_SGLANG` is a RequestError naming it."""
        await self.resume()
        await self._request("GET", "/health", None)
        self._info = None  # the server may have been replaced since it was last read
        info = await self._server_info()
        if (found := release(info.get("version"))) is not None and not self._serve(info) and found < MIN_SGLANG:
            raise RequestError(f"server at {self.base_url} is SGLang {info.get('version')}; relax_gym drives SGLang "
                               f"{'.'.join(map(str, MIN_SGLANG))} or later")
        if info.get("enable_deterministic_inference") is False:
            # SGLang honours `sampling_seed` only in that mode (relax-gym serve always does)
            logger.warning("server at %s ignores per-request seeds (sampling_seed): its samples will not repeat "
                           "from run to run; launch it with --enable-deterministic-inference to seed them",
                           self.base_url)
        model = await self.model_info()
        self._version = version_number(model.get("weight_version"), self._version)
        return model

    async def _server_info(self) -> dict[str, Any]:
        """/server_info (SGLang's launch arguments and release, or relax-gym serve's own), read once; {} from a
        server without the route."""
        if self._info is None:
            try:
                self._info = (await self._get_either("/server_info", "/get_server_info")).json()
            except (RequestError, ValueError):
                self._info = {}
        return self._info

    async def _get_either(self, route: str, older: str) -> httpx.Response:
        """GET `route`, or `older` from a server that answers 404 to it (an SGLang release before the rename)."""
        try:
            return await self._request("GET", route, None)
        except RequestError as err:
            if err.status != 404:
                raise
            return await self._request("GET", older, None)

    @staticmethod
    def _serve(info: Mapping[str, Any]) -> bool:
        """Whether /server_info is `relax-gym serve`'s."""
        return str(info.get("backend", "")).startswith(SERVE_BACKEND)

    async def _needs_session(self) -> bool:
        """Whether tensor and distributed updates need a weight-update session (SGLang 0.5.21+, relax-gym serve)."""
        info = await self._server_info()
        found = release(info.get("version"))
        return self._serve(info) or (found is not None and found >= SESSIONS_SINCE)

    @asynccontextmanager
    async def _weight_session(self) -> AsyncIterator[None]:
        """SGLang 0.5.21+'s weight-update session around one update, closed on every path out of it (a task
        cancelled while the server was opening or closing it included); nothing for a release without sessions."""
        if not await self._needs_session():
            yield
            return
        try:
            await self._open_session()
            yield
        except BaseException:
            try:
                await self._session_call("/end_weight_update")
            except EngineError as err:  # the update's own error is the one to report
                logger.warning("server at %s: closing the weight-update session after a failed update failed "
                               "too: %s", self.base_url, err)
            raise
        self._succeeded("/end_weight_update", await self._session_call("/end_weight_update"))

    async def _open_session(self) -> None:
        """Opens a weight-update session; one that a killed trainer left open is closed and opened again."""
        try:
            self._succeeded("/begin_weight_update", await self._session_call("/begin_weight_update"))
        except RequestError as err:
            if "already open" not in str(err):
                raise
            logger.warning("server at %s had a weight-update session open (a trainer stopped inside one?): "
                           "closing it and opening a new one", self.base_url)
            await self._session_call("/end_weight_update")
            self._succeeded("/begin_weight_update", await self._session_call("/begin_weight_update"))

    async def _session_call(self, route: str) -> httpx.Response:
        """`route` sent and answered even when the caller is cancelled meanwhile (for up to one request's
        timeout), then the cancellation goes on: a begin or end that a cancellation cut off mid-request could
        reach the server after the other, or not at all, and leave a session open there for the next update.
        (A publish that fails on one server cancels the others' updates, which are then closing their sessions.)"""
        call = asyncio.ensure_future(self._request("POST", route, {}))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda t: t.cancelled() or t.exception())  # its error is not the caller's
            await asyncio.wait([call], timeout=self.timeout_s)
            call.cancel()
            raise

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """One request; one that a pause aborts (SGLang's abort mode) is sent again from where it stopped, as
        the prompt plus its tokens so far with the rest of its budget, and waits for the pause to end. Each
        part keeps the version it was generated with (`GenerateOutput.token_versions`)."""
        if request.mm_inputs and not (request.images or request.audios or request.videos):
            raise RequestError("mm_inputs cannot be sent over HTTP: pass the images / audios / videos themselves")
        payload: dict[str, Any] = {
            "input_ids": list(request.input_ids),
            "sampling_params": request.sampling.to_sglang(),
            "return_logprob": True,
        }
        if request.rid is not None:
            payload["rid"] = request.rid
        pushed = self.adapters.newest if request.adapter is None else None
        lora = pushed[0] if pushed is not None else request.adapter
        if lora is not None:  # kept to the end, resumed parts included
            payload["lora_path"] = lora
        if request.return_routed_experts:
            payload["return_routed_experts"] = True
        if request.images:
            payload["image_data"] = [png_data_url(image) for image in request.images]
        if request.audios:
            payload["audio_data"] = [wav_data_url(wave, rate) for wave, rate in request.audios]
        if request.videos:
            payload["video_data"] = [video_data_url(video) for video in request.videos]
        budget = request.sampling.max_new_tokens
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for resumes in range(MAX_RESUMES + 1):
            body = (await self._request("POST", "/generate", payload)).json()
            part = self._output(body, len(payload["input_ids"]), None if pushed is None else pushed[1])
            ids += part.output_ids
            logprobs += part.logprobs
            versions += part.versions()
            if not (_paused_abort(body) and len(ids) < budget):
                break
            payload = {**payload, "input_ids": [*request.input_ids, *ids],
                       "sampling_params": {**payload["sampling_params"], "max_new_tokens": budget - len(ids)}}
            if request.rid is not None:  # a request id of its own: SGLang refuses one it still tracks
                payload["rid"] = f"{request.rid}-resume{resumes + 1}"
        else:
            raise EngineError(f"server at {self.base_url}: request {request.rid!r} was aborted by {MAX_RESUMES + 1} "
                              "pauses in a row")
        token_versions = versions if len(set(versions)) > 1 else None
        # the last part's routes cover the whole sequence: a resent part's prompt holds the earlier parts' tokens
        return GenerateOutput(ids, logprobs, part.finish_reason, part.weight_version, len(request.input_ids),
                              token_versions, part.routed_experts)

    def _output(self, body: dict[str, Any], prompt_tokens: int, adapter_version: int | None = None) -> GenerateOutput:
        """One answer of /generate; `adapter_version`: it ran on a pushed adapter, whose version every token has
        (the server's own version is its base's, and is not taken as the client's)."""
        meta = body.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs") or []
        ids = [int(t) for t in body.get("output_ids") or [p[1] for p in pairs]]
        if [int(p[1]) for p in pairs] != ids:
            raise EngineError(f"server at {self.base_url}: output_token_logprobs do not match output_ids")
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in ("stop", "length", "abort"):
            raise EngineError(f"server at {self.base_url}: unexpected finish_reason {meta.get('finish_reason')!r}")
        ran = int(meta.get("prompt_tokens", prompt_tokens))
        if ran != prompt_tokens and (ids or reason != "abort"):  # a request aborted in the queue ran nothing
            raise EngineError(
                f"server at {self.base_url} ran a prompt of {ran} tokens for the {prompt_tokens} sent: it tokenized "
                "the prompt again (SGLang decodes the ids of a prompt with images, audio or video and runs its "
                "processor on the text), so its tokens and logprobs are not the trajectory's")
        routes = meta.get("routed_experts")  # SGLang's: base64 of int32 [token, layer, top_k]
        experts = None if routes is None else np.frombuffer(base64.b64decode(routes), dtype=np.int32)
        logprobs = [float(p[0]) for p in pairs]
        if adapter_version is not None:
            return GenerateOutput(ids, logprobs, reason, adapter_version, prompt_tokens, None, experts)
        before, self._version = self._version, version_number(meta.get("weight_version"), self._version)
        return GenerateOutput(ids, logprobs, reason, self._version, prompt_tokens,
                              span_versions(meta.get("weight_versions"), len(ids), before), experts)

    async def update_weights(self, weights: Any, version: int) -> None:
        """A folder path goes through /update_weights_from_disk, a state dict through /update_weights_from_tensor:
        shared with a server on this host (`tensor_ipc`: CUDA IPC or shared memory, SGLang's payload), else as
        base64 safetensors, which only `relax-gym serve` reads."""
        if isinstance(weights, (str, os.PathLike)) and (Path(weights) / ADAPTER_CONFIG).is_file():
            await self._load_adapter(Path(weights), version)
        elif isinstance(weights, (str, os.PathLike)):
            await self._update("/update_weights_from_disk", {"model_path": str(weights)}, version)
        elif isinstance(weights, Mapping) and self.share_tensors:
            # this process's memory: `shared` holds it until the server has answered (and copied it)
            shared, self._shared = tensor_ipc.pack(weights, into=self._shared), None
            ranks = int((await self._server_info()).get("tp_size") or 1)
            async with self._weight_session():
                await self._update("/update_weights_from_tensor",
                                   {"serialized_named_tensors": tensor_ipc.serialize(shared, ranks)}, version)
            if all(t.device.type == "cpu" for _, t in shared):
                self._shared = shared  # answered, so done with: refilled next time (a GPU buffer goes back to torch)
        elif isinstance(weights, Mapping):
            if not self._serve(await self._server_info()):
                raise RequestError(
                    f"update_weights: the server at {self.base_url} is SGLang, whose /update_weights_from_tensor "
                    "takes tensors shared from its own host (share_tensors is off: by default, for a URL that is not "
                    "loopback), not a state dict over HTTP: send a folder (weight_sync: disk) or broadcast the "
                    "weights (weight_sync: distributed)")
            # Copies: safetensors refuses tensors sharing storage (tied embeddings) and non-CPU ones.
            blob = save({k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()})
            async with self._weight_session():
                await self._update("/update_weights_from_tensor",
                                   {"safetensors_b64": base64.b64encode(blob).decode()}, version)
        else:
            raise RequestError(f"update_weights: expected a folder path or a state dict, got {type(weights)}")

    async def _load_adapter(self, folder: Path, version: int) -> None:
        """Loads the PEFT adapter folder as `relax-gym-{run}-v{version}` (`/load_lora_adapter`) for every later
        request, then unloads those older than the newest `keep_adapters` (`PushedAdapters.load`)."""
        try:
            await self.adapters.load(self._request, folder, version, load_route="/load_lora_adapter",
                                     unload_route="/unload_lora_adapter")
        except RequestError as err:
            if err.status == 404 or "not enabled" in str(err):
                raise RequestError(f"server at {self.base_url} cannot load LoRA adapters: {LORA_HINT}") from None
            raise
        self._version = version

    async def _update(self, route: str, payload: dict[str, Any], version: int) -> None:
        """One weight route with `version`; the server must say it succeeded."""
        # flush_cache false: `pause` flushed already, and SGLang asserts (before 0.5.22) when a flush fails
        payload |= {"weight_version": str(version), "flush_cache": False}
        self._succeeded(route, await self._request("POST", route, payload))
        self._version = version

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "nccl",
    ) -> None:
        """Has the server join the trainer's group `group_name` as rank `rank_offset` of `world_size`. The server
        answers once every rank has joined, so the trainer joins its side (rank 0) meanwhile: see
        `relax_gym.trainer.weight_publish.DistributedPublisher`, which does both."""
        payload = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                   "world_size": world_size, "group_name": group_name, "backend": backend}
        self._succeeded("/init_weights_update_group", await self._request("POST", "/init_weights_update_group",
                                                                        payload))

    async def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[torch.dtype | str], shapes: Sequence[Sequence[int]],
        group_name: str, version: int,
    ) -> None:
        """Has the server receive `names` by broadcast from rank 0 of `group_name`, in this order, then load them
        and take `version`. Returns when it has: rank 0 broadcasts the tensors meanwhile (inside a weight-update
        session where the server needs one)."""
        async with self._weight_session():
            await self._update("/update_weights_from_distributed", {
                "names": list(names),
                "dtypes": [d if isinstance(d, str) else dtype_name(d) for d in dtypes],
                "shapes": [[int(n) for n in shape] for shape in shapes],
                "group_name": group_name,
            }, version)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        route = "/destroy_weights_update_group"
        self._succeeded(route, await self._request("POST", route, {"group_name": group_name}))

    def _succeeded(self, route: str, response: httpx.Response) -> None:
        body = response.json()
        if not body.get("success", False):
            raise EngineError(f"server at {self.base_url} refused {route}: {body.get('message')}")

    async def pause(self) -> None:
        """SGLang's abort mode, as slime pauses: running requests end now with what they have (their `generate`
        calls send the rest again, which waits for `resume`), then /flush_cache is retried until the server is
        idle, so the weight update that follows needs no flush of its own."""
        await self._request("POST", "/pause_generation", {"mode": "abort"})
        deadline = time.monotonic() + self.flush_timeout_s
        attempt = 0
        while True:
            try:
                await self._request("POST", "/flush_cache", None)
                return
            except RequestError as err:  # 400: requests are still winding down
                attempt += 1
                if time.monotonic() >= deadline:
                    raise EngineError(f"server at {self.base_url} was not idle {self.flush_timeout_s:g} s after "
                                      f"an abort-mode pause (/flush_cache kept refusing): {err}") from None
                await asyncio.sleep(min(backoff_delay(attempt, 0.05, 1.0), max(deadline - time.monotonic(), 0)))

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache", None)

    async def model_info(self) -> dict[str, Any]:
        """/model_info (`/get_model_info` before SGLang renamed it): the model, and the live `weight_version`."""
        return (await self._get_either("/model_info", "/get_model_info")).json()


#: a `python -m sglang.launch_server` subprocess
SGLangServer = ServerProcess


def lora_args(rank: int, adapters: int) -> list[str]:
    """The flags that let an SGLang server load adapters of `rank` on any linear layer at runtime and batch
    `adapters` of them: a push loads the newest before it unloads the oldest, so one more may be loaded
    (SGLang also refuses fewer loaded adapters than a batch may hold, whose default is 8)."""
    return ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", "all", "--max-loras-per-batch",
            str(adapters), "--max-loaded-loras", str(adapters + 1)]


def launch_sglang_server(
    model_path: str | os.PathLike, port: int, *extra_args: str, host: str = "127.0.0.1", timeout_s: float = 600.0,
    command: Sequence[str] | None = None, die_with_parent: bool = False,
) -> SGLangServer:
    """Starts SGLang on `model_path` and waits until /health answers 200; its log goes to a temp file.

    `command` replaces `python -m sglang.launch_server` (a wrapper, a container, a fake in tests): it is given
    SGLang's own arguments. `die_with_parent` has the kernel kill the server when the thread that started it
    ends (Linux; an engine actor's server must not outlive a killed actor)."""
    if command is None and importlib.util.find_spec("sglang") is None:
        raise EngineError(
            f"sglang is not installed in {sys.executable}: install it (pip install 'relax-gym[sglang]') on a "
            "machine it supports, or serve the embedded engine instead (relax-gym serve --model ...)"
        )
    base = list(command) if command is not None else [sys.executable, "-m", "sglang.launch_server"]
    return start_server([*base, "--model-path", str(model_path), "--host", host, "--port", str(port), *extra_args],
                        f"http://{host}:{port}", "sglang.launch_server", timeout_s=timeout_s,
                        die_with_parent=die_with_parent)
