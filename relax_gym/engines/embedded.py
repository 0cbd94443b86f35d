"""The embedded engine: a transformers model in-process, batching concurrent requests.

One worker thread owns the model. `generate()` calls queue jobs, so the event
loop never runs torch code and concurrent episodes share forward passes. Text
models batch continuously (`relax_gym.engines.continuous`): each step, queued
requests (up to `max_batch_size` rows in all) are prefilled and join the running
batch, and rows leave it as they stop. Models with a processor, and
`batching="static"`, batch statically: the worker takes everything pending
(after a short coalescing window) and runs it as one left-padded
`model.generate` call, which runs until its last row stops while requests
arriving meanwhile form the next batch.

Statically, `model.generate` keeps the model-specific work (KV cache, Qwen-VL's M-RoPE
positions under left padding, splicing image / audio features in at prefill);
per-row sampling (`relax_gym.engines.sampling`) and stopping live in `_BatchDecoder`, which samples
from the raw logits captured by a forward hook, so no processor `generate` adds from a
checkpoint's generation_config can change what the reported logprobs mean.

Media placeholder tokens (`<|image_pad|>`, `<|AUDIO|>`, ...) are never sampled:
one in an output has no features behind it, and the trainer's forward over the
trajectory then fails ("Image features and image tokens do not match", a known
crash of RL stacks whose engines allow it). Like top-k / top-p, this shapes
only the choice; logprobs stay log softmax(logits / T) over the full vocabulary.

The worker applies weight updates between batches (under continuous batching,
once the running rows have finished, admitting none meanwhile), so each output
comes from one version; being the only thread that touches the model, it needs
no lock around it. Both paths sample with the same `RowSampler`, so a seeded
request gets the same tokens either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.core_model_loading import revert_weight_conversion

from relax_gym.cpu.decode_attention import use_decode_attention
from relax_gym.cpu.onednn_linear import use_onednn_linears
from relax_gym.cpu.process import prepare_process
from relax_gym.cpu.threads import ThreadPlacement, release_openmp_workers
from relax_gym.engines.base import (
    EngineError,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    RequestError,
    SamplingParams,
)
from relax_gym.engines.continuous import RunningBatch, left_padded, supports_continuous_batching
from relax_gym.engines.resident_adapters import ResidentAdapters
from relax_gym.engines.sampling import RowSampler, seeded_generators
from relax_gym.models import LoadedModel, concat_media, encode_media
from relax_gym.models.inputs import takes_token_types
from relax_gym.models.moe_routing import recording, routers
from relax_gym.video import Video, VideoError

#: "continuous": requests join a running batch (text-only models); "static": one `generate` per batch
Batching = Literal["continuous", "static"]

#: requests decoded together by default (`rollout.engine_max_batch_size` reads it here)
MAX_BATCH_SIZE = 64


def engine_dtype(name: str) -> torch.dtype | None:
    """`rollout.engine_dtype` as the engine takes it: None for "auto", else the torch dtype it names."""
    if name not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"engine_dtype must be 'auto', 'float32' or 'bfloat16', got {name!r}")
    return None if name == "auto" else getattr(torch, name)


def engine_device(name: str) -> torch.device:
    """`rollout.engine_device` as a device: "auto" is the first GPU where torch sees one, else the CPU; "cpu",
    "cuda" and "cuda:N" must exist here (ValueError says why not)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name!r} is not a device: 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"{name!r}: torch sees {torch.cuda.device_count()} CUDA device(s) on this machine")
    return device


# Processor outputs that are per token, not per image / clip: the engine builds them for the padded batch.
TOKEN_KEYS = frozenset({"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "position_ids"})


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any) -> None:
    """Completes `future` on its own loop from the worker thread; a closed loop has no one waiting."""

    def complete() -> None:
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(complete)


@dataclass(eq=False)  # compared by identity: the deque of queued jobs is searched for one
class _Job:
    request: GenerateRequest
    mm_inputs: dict[str, torch.Tensor]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    #: set past the caller's deadline: the row ends with "abort" at its next step, keeping what it generated
    aborted: bool = False
    #: `EmbeddedEngine.pause(abort=True)` calls before this job arrived: a later one aborts it
    aborts_seen: int = 0
    #: the engine's count of running requests, once the worker has taken this one (it leaves it when answered)
    running: _Running | None = None

    def resolve(self, value: GenerateOutput | BaseException) -> None:
        if self.running is not None:  # before the answer is sent: whoever reads it finds the engine without it
            self.running.leave()
            self.running = None
        _resolve(self.loop, self.future, value)


class _Running:
    """Requests taken by the worker and not yet answered (SGLang's running requests)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def join(self, job: _Job) -> None:
        with self._lock:
            self.count += 1
        job.running = self

    def leave(self) -> None:
        with self._lock:
            self.count -= 1


@dataclass(eq=False)
class _Row:
    """One request decoding in the running batch (continuous batching)."""

    job: _Job
    #: the weights it decodes with: updates wait for an empty batch, so it is the version it started on
    version: int
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class _Update:
    tensors: dict[str, torch.Tensor]
    version: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass
class _AdapterChange:
    """A LoRA adapter loaded or unloaded (`ResidentAdapters`), applied as a weight update is: between batches."""

    change: Callable[[], None]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def finish_reason(ids: list[int], params: SamplingParams, *, stop_id: bool, aborted: bool,
                  decode: Callable[[list[int]], str]) -> FinishReason | None:
    """Why a row with output `ids` (its newest token just added) ends now, or None if it goes on. Stop strings
    are looked for in enough trailing tokens to hold any of them, even at one byte per token."""
    if aborted:
        return "abort"
    if stop_id:
        return "stop"
    if params.stop:
        window = 4 * max(map(len, params.stop)) + 4
        if any(s in decode(ids[-window:]) for s in params.stop):
            return "stop"
    if len(ids) >= params.max_new_tokens:
        return "length"
    return None


class _BatchDecoder(LogitsProcessor):
    """Per-row sampling and stop bookkeeping for one batch, installed as generate's logits processor.

    Each step it samples every row from the raw logits under that row's own params (`RowSampler`),
    records token and logprob, decides which rows stop, and returns scores that make
    generate's greedy pick exactly the sampled tokens.
    """

    def __init__(
        self,
        params: Sequence[SamplingParams],
        *,
        eos: frozenset[int],
        vocab: int,
        device: torch.device,
        generator: torch.Generator,
        decode: Callable[[list[int]], str],
        aborted: Callable[[int], bool],
        never: Sequence[int] = (),
    ) -> None:
        self.params = list(params)
        rows = len(params)
        self.sampler = RowSampler(params, device=device, generator=generator, never=never)
        self.stop_ids = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        for i, p in enumerate(params):
            self.stop_ids[i, sorted(eos | set(p.stop_token_ids))] = True
        self.decode, self.aborted = decode, aborted
        self.output_ids: list[list[int]] = [[] for _ in params]
        self.logprobs: list[list[float]] = [[] for _ in params]
        self.reasons: list[FinishReason | None] = [None] * rows
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.rows = torch.arange(rows, device=device)
        self.raw: torch.Tensor | None = None

    def capture(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook: the model's last-position logits, before any logits processor."""
        self.raw = output.logits[:, -1].float()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        assert self.raw is not None, "the logits hook did not run"
        tokens, logprobs = self.sampler.sample(self.raw)
        hit_stop_id = self.stop_ids[self.rows, tokens]
        step = torch.stack([tokens.double(), logprobs.double(), hit_stop_id.double()]).tolist()
        for i, (token, logprob, stop_id) in enumerate(zip(*step, strict=True)):
            if self.reasons[i] is None:
                self.output_ids[i].append(int(token))
                self.logprobs[i].append(logprob)
                self.reasons[i] = self._finish(i, bool(stop_id))
        if any(r is not None for r in self.reasons):
            self.done = torch.tensor([r is not None for r in self.reasons], device=self.done.device)
        # transformers types the hook with torch's legacy FloatTensor, which no tensor op is typed to return
        return torch.full_like(scores, -torch.inf).scatter_(1, tokens[:, None], 0.0)  # type: ignore[return-value]

    def _finish(self, i: int, stop_id: bool) -> FinishReason | None:
        return finish_reason(self.output_ids[i], self.params[i], stop_id=stop_id, aborted=self.aborted(i),
                             decode=self.decode)


class _Stopper(StoppingCriteria):
    """Per-row stop flags, as `_BatchDecoder` decided them this step."""

    def __init__(self, decoder: _BatchDecoder) -> None:
        self.decoder = decoder

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return self.decoder.done.clone()  # type: ignore[return-value]  # legacy BoolTensor in transformers' hook


class EmbeddedEngine:
    """The `Engine` protocol over a transformers model in this process (CPU or one GPU)."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_batch_size: int = MAX_BATCH_SIZE,
        seed: int = 0,
        batch_window_s: float = 0.005,
        batching: Batching = "continuous",
        placement: ThreadPlacement | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """`device` (None: where the model is) moves `loaded.model` there, in bfloat16 on a GPU as SGLang serves
        bf16 checkpoints; `dtype` (None: that default, else the model's own) casts it. The engine owns the model
        from then on: it moves and casts it in place. On a CPU, continuous batching decodes with `decode_attention`
        (torch's fused kernel is slower there). The process gets the CLI's settings (`prepare_process`), before
        the engine's thread starts."""
        prepare_process()
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {batching!r}")
        self.loaded = loaded
        if device is not None:  # `to` is a no-op where the model already is; "cuda" is never equal to "cuda:0"
            device = torch.device(device)
            dtype = dtype or (torch.bfloat16 if device.type == "cuda" else None)
        if device is not None or dtype is not None:
            loaded.model.to(device=device, dtype=dtype)  # type: ignore[call-arg]  # transformers' @wraps-typed `to`
        self.model = loaded.model.eval()
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.device = next(self.model.parameters()).device
        if self.device.type == "cuda":
            # cuDNN's attention builds a graph for each new sequence length, so a decode step, one token longer
            # than the last, pays it every layer of every step (on an H100: 2 ms of CPU a layer, two thirds of a
            # step); flash and memory-efficient attention have no such cost. Process-wide, as torch's flag is.
            torch.backends.cuda.enable_cudnn_sdp(False)
        else:
            use_onednn_linears(self.model)  # float32 products at oneDNN's rate, not MKL's (`onednn_linear`)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.eos_token_ids = loaded.stop_token_ids()
        self.placeholder_token_ids = self._placeholder_ids()
        self._routers = routers(self.model)
        tokenizer = loaded.tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_token_ids)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._mm_token_types = loaded.processor is not None and takes_token_types(self.model)
        #: whether requests join a running batch (`relax_gym.engines.continuous`): asked for, and the model allows
        self.continuous = batching == "continuous" and supports_continuous_batching(
            self.model, loaded.processor is not None
        )
        if self.continuous and self.device.type == "cpu":
            use_decode_attention(self.model)
        #: LoRA adapters loaded by name, which requests name (`GenerateRequest.adapter`); none at first
        self.adapters = ResidentAdapters(self.model)
        self._version = 0
        self._paused = False
        self._aborts = 0  # `pause(abort=True)` calls so far
        self._closed = False
        self._busy = False  # a batch is running (what `pause` waits for)
        self._running = _Running()
        self._jobs: deque[_Job] = deque()
        #: the running batch's rows under continuous batching, and the jobs joining it (the worker's own, read
        #: after it fails)
        self._rows: list[_Row] = []
        self._admitting: list[_Job] = []
        self._updates: deque[_Update | _AdapterChange] = deque()
        self._cond = threading.Condition()
        self._processor_lock = threading.Lock()
        self._placement = placement or ThreadPlacement()
        self._worker = threading.Thread(target=self._loop, name="relax-gym-embedded-engine", daemon=True)
        self._worker.start()
        release_openmp_workers()  # this thread's, from loading the model: the worker computes from here

    # --- the Engine protocol ---------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    async def generate(self, request: GenerateRequest, *, timeout_s: float | None = None) -> GenerateOutput:
        """`timeout_s` bounds the wait: past it the request ends with finish_reason "abort" and the tokens
        it has so far (none if it was still queued). Cancelling the call drops the request at its next step."""
        self._check_open()
        self._validate(request)
        if request.sampling.max_new_tokens == 0:
            return GenerateOutput([], [], "length", self._version, len(request.input_ids))
        mm_inputs = await self._mm_inputs(request)
        loop = asyncio.get_running_loop()
        job = _Job(request, mm_inputs, loop.create_future(), loop)
        with self._cond:
            self._check_open()
            job.aborts_seen = self._aborts
            self._jobs.append(job)
            self._cond.notify_all()
        if timeout_s is None:
            return await job.future  # cancelling the call cancels the future
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), timeout_s)
        except TimeoutError:
            self._abort(job)
            return await job.future
        except asyncio.CancelledError:
            job.future.cancel()
            raise

    @property
    def context_length(self) -> int | None:
        """The most tokens (prompt and output) the model takes, from its config; None if it does not say."""
        config = self.model.config
        for source in (config, getattr(config, "text_config", None)):
            value = getattr(source, "max_position_embeddings", None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    async def update_weights(self, weights: Any, version: int) -> None:
        """Copies `weights` (a state dict, or an HF folder of *.safetensors) into the model between
        batches and sets the version; every key and shape is checked before anything is copied."""
        self._check_open()
        if isinstance(version, bool) or not isinstance(version, int):
            raise RequestError(f"update_weights: version must be an int, got {version!r}")
        tensors = await asyncio.to_thread(self._checked_tensors, weights)
        loop = asyncio.get_running_loop()
        update = _Update(tensors, version, loop.create_future(), loop)
        with self._cond:
            self._check_open()
            self._updates.append(update)
            self._cond.notify_all()
        await update.future

    async def load_adapter(self, name: str, folder: str | os.PathLike[str]) -> None:
        """Loads the PEFT adapter folder as `name`, for the requests that name it; the base and other adapters
        stay as they are. Applied between batches, as weight updates are."""
        await self._change_adapters(functools.partial(self.adapters.load, name, folder))

    async def unload_adapter(self, name: str) -> None:
        """Unloads adapter `name` between batches; queued requests naming it then fail."""
        await self._change_adapters(functools.partial(self.adapters.unload, name))

    async def _change_adapters(self, change: Callable[[], None]) -> None:
        self._check_open()
        loop = asyncio.get_running_loop()
        item = _AdapterChange(change, loop.create_future(), loop)
        with self._cond:
            self._check_open()
            self._updates.append(item)
            self._cond.notify_all()
        await item.future

    async def pause(self, *, abort: bool = False) -> None:
        """Returns once the running batch (if any) has finished; requests that arrive meanwhile wait for
        `resume`. `abort=True` is SGLang's abort mode: running requests end at their next step with
        finish_reason "abort" and the tokens they have, queued ones at once with none."""
        with self._cond:
            self._paused = True
            queued: list[_Job] = []
            if abort:
                self._aborts += 1
                queued = list(self._jobs)
                self._jobs.clear()
        self._end_unstarted(queued)
        await asyncio.to_thread(self._wait_idle)

    @property
    def busy(self) -> bool:
        """Whether requests are running, taken and not yet answered (SGLang's `/flush_cache` is refused then).
        A request leaves before its answer is sent, so its caller never finds the engine busy with it."""
        return self._running.count > 0

    async def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    async def connect(self) -> dict[str, Any]:
        """In-process: ready once built."""
        return {"model_path": self.loaded.name}

    async def health(self) -> bool:
        return not self._closed and self._worker.is_alive()

    async def close(self) -> None:
        """Stops the worker: the running batch ends with finish_reason "abort" at its next step,
        queued requests get "abort" outputs, pending weight updates an EngineError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        await asyncio.to_thread(self._worker.join)

    # --- preparing requests ----------------------------------------------------------------

    def encode(
        self, text: str, images: Sequence[Image.Image] = (), audios: Sequence[tuple[np.ndarray, int]] = (),
        videos: Sequence[Video] = (),
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Token ids for `text` with its media placeholders expanded, and the media's processor
        outputs, exactly as `relax_gym.models.processor_inputs` makes them. Thread-safe."""
        if self.loaded.processor is None and (images or audios or videos):
            raise RequestError(f"model {self.loaded.name!r} takes text only, not images, audio or video")
        with self._processor_lock:  # processors are not thread-safe
            try:
                out = encode_media(self.loaded, text, images, audios, videos)
            except VideoError as err:
                raise RequestError(str(err)) from None
            except ValueError as err:  # the processor's own checks: placeholders that do not match the media
                raise RequestError(f"the prompt and its media do not match: {err}") from None
        return out["input_ids"][0].tolist(), {k: v for k, v in out.items() if k not in TOKEN_KEYS}

    def _placeholder_ids(self) -> tuple[int, ...]:
        """The image / video / audio placeholder ids the processor expands and the model fills."""
        if self.loaded.processor is None:
            return ()
        sources = (self.model.config, self.loaded.processor)
        names = [f"{kind}_token_{suffix}" for kind in ("image", "video", "audio") for suffix in ("id", "index")]
        found = {getattr(source, name, None) for source in sources for name in names}
        return tuple(sorted(i for i in found if isinstance(i, int) and 0 <= i < self.vocab_size))

    def _ends(self, job: _Job) -> bool:
        """Whether a running job stops at this step with finish_reason "abort", keeping what it generated."""
        return self._closed or job.aborted or job.aborts_seen < self._aborts or job.future.cancelled()

    def _abort(self, job: _Job) -> None:
        """Ends `job`: at once if it is still queued, else at its batch's next step (see `_BatchDecoder`)."""
        with self._cond:
            job.aborted = True
            queued = job in self._jobs
            if queued:
                self._jobs.remove(job)
        if queued:
            self._end_unstarted([job])

    def _end_unstarted(self, jobs: list[_Job]) -> None:
        """Answers jobs taken off the queue before they ran: finish_reason "abort", no tokens."""
        for job in jobs:
            job.resolve(GenerateOutput([], [], "abort", self._version, len(job.request.input_ids)))

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"the embedded engine for {self.loaded.name!r} is closed")

    def _validate(self, request: GenerateRequest) -> None:
        ids, params = request.input_ids, request.sampling
        if not ids:
            raise RequestError("input_ids: empty")
        self.adapters.check(request.adapter)
        if request.return_routed_experts and not self._routers:
            raise RequestError(f"return_routed_experts: model {self.loaded.name!r} has no mixture-of-experts routers")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"input_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        for kind, given in (("image", request.images), ("audio", request.audios), ("video", request.videos)):
            if given and kind not in self.loaded.modalities:
                raise RequestError(f"{kind}s given but model {self.loaded.name!r} takes {self.loaded.modalities}")
        checks = {
            "temperature": params.temperature >= 0,
            "top_p": 0 < params.top_p <= 1,
            "top_k": params.top_k >= 0,
            "max_new_tokens": params.max_new_tokens >= 0,
            "stop_token_ids": all(0 <= t < self.vocab_size for t in params.stop_token_ids),
            "stop": all(isinstance(s, str) and s for s in params.stop),
        }
        if failed := [name for name, ok in checks.items() if not ok]:
            raise RequestError(f"sampling.{failed[0]}: invalid value in {params}")

    async def _mm_inputs(self, request: GenerateRequest) -> dict[str, torch.Tensor]:
        """The request's processor outputs: its own `mm_inputs`, else the processor run on its images / audios."""
        if request.mm_inputs:
            return {k: v for k, v in request.mm_inputs.items() if k not in TOKEN_KEYS}
        if not (request.images or request.audios or request.videos):
            return {}
        processor = self.loaded.processor
        placeholders = getattr(processor, "image_token", "") * len(request.images)
        placeholders += getattr(processor, "audio_token", "") * len(request.audios)
        placeholders += getattr(processor, "video_token", "") * len(request.videos)
        _, mm_inputs = await asyncio.to_thread(self.encode, placeholders, request.images, request.audios,
                                               request.videos)
        return mm_inputs

    def _checked_tensors(self, weights: Any) -> dict[str, torch.Tensor]:
        """`weights` as {model parameter name: tensor}; raises an EngineError naming any bad key or shape."""
        if isinstance(weights, (str, os.PathLike)):
            weights = _read_checkpoint(Path(weights))
        if not isinstance(weights, Mapping) or not weights:
            raise RequestError(f"update_weights: expected a non-empty state dict or folder, got {type(weights)}")
        if self.adapters:
            raise RequestError(f"update_weights: LoRA adapters are loaded ({sorted(self.adapters.folders)}): unload "
                               "them before updating the base weights")
        targets = self.model.state_dict(keep_vars=True)
        checked: dict[str, torch.Tensor] = {}
        for key, value in weights.items():
            name = key if key in targets else self._checkpoint_names.get(key)
            if name is None:
                raise RequestError(f"update_weights: {key!r} is not a parameter of {self.loaded.name!r}")
            if problem := _weight_problem(value, targets[name]):
                raise RequestError(f"update_weights: {key!r} {problem}")
            checked[name] = value
        return checked

    @functools.cached_property
    def _checkpoint_names(self) -> dict[str, str]:
        """Checkpoint key → parameter name, where save_pretrained renames keys (e.g. Qwen2-Audio's
        `audio_tower.*` is `model.audio_tower.*` in memory): inverts transformers' own renaming."""
        state = self.model.state_dict()
        by_id = {id(t): name for name, t in state.items()}
        saved = revert_weight_conversion(self.model, dict(state))
        return {key: by_id[id(t)] for key, t in saved.items() if id(t) in by_id}

    # --- the worker ------------------------------------------------------------------------

    def _has_work(self) -> bool:
        return self._closed or bool(self._updates) or (not self._paused and bool(self._jobs))

    def _wait_idle(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._busy or self._closed)

    def _loop(self) -> None:
        self._placement.apply()
        try:
            if self.continuous:
                self._loop_continuous()
            else:
                self._loop_static()
        except Exception as err:  # a bug in the worker itself: every caller hears of it, none is left waiting
            failure = EngineError(f"the embedded engine's worker failed: {err!r}")
            with self._cond:
                self._closed = True
                jobs = [*self._admitting, *(row.job for row in self._rows), *self._jobs]
                self._admitting.clear()
                self._rows.clear()
                self._jobs.clear()
                self._cond.notify_all()
            for job in jobs:
                job.resolve(failure)
            self._drain()
            raise

    def _wait_for_jobs(self) -> bool:
        """With nothing running: applies weight updates as they come, and returns once there are jobs to take
        (True) or the engine is closed (False)."""
        while True:
            if not self._has_work():  # idle: its OpenMP workers would slow whoever computes (`cpu_threads`)
                release_openmp_workers()
            with self._cond:
                self._cond.wait_for(self._has_work)
                if self._closed:
                    return False
                update = self._updates.popleft() if self._updates else None
            if update is None:
                return True
            self._apply(update)

    def _loop_static(self) -> None:
        while self._wait_for_jobs():
            self._coalesce()
            with self._cond:
                jobs = self._take()
                self._busy = bool(jobs)
            try:
                if jobs:
                    self._run(jobs, self._version)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
        self._drain()

    def _coalesce(self) -> None:
        """Waits up to `batch_window_s` for a burst of concurrent requests to finish arriving."""
        deadline = time.monotonic() + self.batch_window_s
        with self._cond:
            while len(self._jobs) < self.max_batch_size and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return

    def _take(self, limit: int | None = None) -> list[_Job]:
        jobs: list[_Job] = []
        limit = self.max_batch_size if limit is None else limit
        while self._jobs and len(jobs) < limit and not self._paused:
            job = self._jobs.popleft()
            if not job.future.cancelled():
                self._running.join(job)
                jobs.append(job)
        return jobs

    def _drain(self) -> None:
        """After close: nothing queued may hang."""
        with self._cond:
            jobs, updates = list(self._jobs), list(self._updates)
            self._jobs.clear()
            self._updates.clear()
        self._end_unstarted(jobs)
        for update in updates:
            _resolve(update.loop, update.future, EngineError("the embedded engine closed before the update"))

    def _apply(self, update: _Update | _AdapterChange) -> None:
        if isinstance(update, _AdapterChange):
            try:
                update.change()
            except Exception as err:  # a refused adapter: the caller's error; the model is as it was
                _resolve(update.loop, update.future, err if isinstance(err, EngineError) else EngineError(
                    f"changing the LoRA adapters failed: {err!r}"))
                return
            _resolve(update.loop, update.future, None)
            return
        targets = self.model.state_dict(keep_vars=True)
        try:
            with torch.no_grad():
                for name, value in update.tensors.items():
                    targets[name].copy_(value)
        except Exception as err:  # a copy that fails part way leaves mixed weights: say so
            _resolve(update.loop, update.future, EngineError(f"update_weights failed part way: {err!r}"))
            return
        self._version = update.version
        _resolve(update.loop, update.future, None)

    def _run(self, jobs: list[_Job], version: int) -> None:
        """One batch; if it fails, its rows run one by one so a bad request fails alone."""
        try:
            outputs = self._generate(jobs, version)
        except Exception as err:
            if len(jobs) > 1:
                for job in jobs:
                    self._run([job], version)
                return
            jobs[0].resolve(_failed_alone(jobs[0], err))
            return
        for job, output in zip(jobs, outputs, strict=True):
            self._answer(job, output)

    # --- continuous batching ---------------------------------------------------------------

    def _loop_continuous(self) -> None:
        """One running batch: queued requests join it every step, finished rows leave it at once.

        Nothing joins while a weight update waits, so the running rows finish on the weights they
        started with (each output has one version) and the update lands when the batch is empty,
        as between static batches; a pause likewise lets the running rows finish.
        """
        batch = RunningBatch(self.model, self.pad_token_id)
        rows = self._rows
        while True:
            if not rows:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                if not self._wait_for_jobs():
                    break
                self._coalesce()
            with self._cond:
                jobs = [] if self._updates or self._closed else self._take(self.max_batch_size - len(rows))
                self._busy = bool(jobs or rows)
            if jobs:
                self._admitting[:] = jobs
                self._admit(batch, rows, jobs)
                self._admitting.clear()
            if rows:
                self._advance(batch, rows)
        self._drain()

    def _admit(self, batch: RunningBatch, rows: list[_Row], jobs: list[_Job]) -> None:
        """Prefills `jobs`, samples their first tokens and adds the rows that go on to `batch`; a prefill, a
        seed or a first sample that fails is retried one job at a time, so a bad request fails alone and the
        worker never dies of a request's error. Jobs of different adapters prefill apart (a shared prompt
        prefix runs once for a group: its cache is its adapter's)."""
        groups: dict[str | None, list[_Job]] = {}
        for job in jobs:
            groups.setdefault(job.request.adapter, []).append(job)
        if len(groups) > 1:
            for group in groups.values():
                self._admit(batch, rows, group)
            return
        adapter = jobs[0].request.adapter
        try:
            self.adapters.check(adapter)  # unloaded while the job was queued
            with self.adapters.rows(adapter):
                joining, logits = batch.prefill([job.request.input_ids for job in jobs],
                                                room=[max(0, job.request.sampling.max_new_tokens - 1)
                                                      for job in jobs])
            new = [_Row(job, self._version, seeded_generators([job.request.sampling], self.device)[0])
                   for job in jobs]
            going, tokens = self._sample(new, logits)
        except Exception as err:
            if len(jobs) > 1:
                for job in jobs:
                    self._admit(batch, rows, [job])
                return
            jobs[0].resolve(_failed_alone(jobs[0], err))
            return
        if going:  # rows that ended on their first token never join
            order = joining.keep(going)
            joining.last = tokens[order]
            rows += [new[i] for i in order]
            batch.join(joining)

    def _advance(self, batch: RunningBatch, rows: list[_Row]) -> None:
        """One decode step of every running row; a step that fails ends them all with its error."""
        try:
            with self.adapters.rows([row.job.request.adapter for row in rows]):
                logits = batch.step()
        except Exception as err:
            for row in rows:
                row.job.resolve(EngineError(f"generation failed for request {row.job.request.rid!r}: {err!r}"))
            rows.clear()
            batch.keep([])
            return
        going, tokens = self._sample(rows, logits)
        order = batch.keep(going)
        batch.last = tokens[order]
        rows[:] = [rows[i] for i in order]

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Samples each row's next token, answers the rows that end; returns the rows that go on and all tokens."""
        params = [row.job.request.sampling for row in rows]
        sampler = RowSampler(params, device=self.device, generator=self._generator, never=self.placeholder_token_ids,
                             row_generators=[row.generator for row in rows])
        tokens, logprobs = sampler.sample(logits)
        going: list[int] = []
        for i, (row, token, logprob) in enumerate(zip(rows, *torch.stack([tokens.double(), logprobs.double()]).tolist(),
                                                      strict=True)):
            token = int(token)
            row.output_ids.append(token)
            row.logprobs.append(logprob)
            job = row.job
            reason = finish_reason(
                row.output_ids, job.request.sampling, decode=self.loaded.decode,
                stop_id=token in self.eos_token_ids or token in job.request.sampling.stop_token_ids,
                aborted=self._ends(job),
            )
            if reason is None:
                going.append(i)
            else:
                self._answer(job, GenerateOutput(row.output_ids, row.logprobs, reason, row.version,
                                                 len(job.request.input_ids)))
        return going, tokens

    # --- static batching --------------------------------------------------------------------

    def _generate(self, jobs: list[_Job], version: int) -> list[GenerateOutput]:
        for job in jobs:
            self.adapters.check(job.request.adapter)  # unloaded while the job was queued
        prompts = [job.request.input_ids for job in jobs]
        inputs = self._batch_inputs(prompts, [job.mm_inputs for job in jobs])
        decoder = _BatchDecoder(
            [job.request.sampling for job in jobs],
            eos=self.eos_token_ids,
            vocab=self.model.get_output_embeddings().out_features,
            device=self.device,
            generator=self._generator,
            decode=self.loaded.decode,
            aborted=lambda i: self._ends(jobs[i]),
            never=self.placeholder_token_ids,
        )
        config = GenerationConfig(
            max_new_tokens=max(job.request.sampling.max_new_tokens for job in jobs),
            do_sample=False,
            num_beams=1,
            eos_token_id=sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            # Neutral values, so none is filled in from the checkpoint's generation_config.
            temperature=1.0,
            top_p=1.0,
            top_k=50,
            repetition_penalty=1.0,
        )
        hook = self.model.register_forward_hook(decoder.capture)
        try:
            with torch.inference_mode(), self.adapters.rows([job.request.adapter for job in jobs]):
                self.model.generate(
                    **inputs,
                    generation_config=config,
                    logits_processor=LogitsProcessorList([decoder]),
                    stopping_criteria=StoppingCriteriaList([_Stopper(decoder)]),
                )
        finally:
            hook.remove()
        return [
            GenerateOutput(ids, lps, reason or "length", version, len(prompt))
            for ids, lps, reason, prompt in zip(
                decoder.output_ids, decoder.logprobs, decoder.reasons, prompts, strict=True
            )
        ]

    def _answer(self, job: _Job, output: GenerateOutput) -> None:
        """Resolves `job` with `output`, and its routed experts when it asked for them."""
        if job.request.return_routed_experts:
            try:
                output = replace(output, routed_experts=self._routed_experts(job, output.output_ids))
            except Exception as err:  # this request's failure, not the batch's
                job.resolve(EngineError(f"routed experts of request {job.request.rid!r}: {err!r}"))
                return
        job.resolve(output)

    def _routed_experts(self, job: _Job, output_ids: list[int]) -> np.ndarray:
        """SGLang's layout ([token, layer, top_k] int32, flat) of the sequence the model ran: prompt and output
        but the last token. One forward of that sequence, on the weights and in the dtype that generated it (an
        update waits for the batch to empty), rather than the decode steps' own routes, which would need every
        row tracked through the running batch's padding; the two differ only by floating-point order (a
        token's route does not depend on its batch)."""
        ran = [*job.request.input_ids, *output_ids][:-1]
        if not ran:
            return np.empty(0, dtype=np.int32)
        inputs = self._batch_inputs([ran], [job.mm_inputs])
        with recording(self.model) as routes, torch.no_grad(), self.adapters.rows(job.request.adapter):
            self.model(**inputs)
        return torch.stack([layer[0] for layer in routes], dim=1).to(torch.int32).cpu().numpy().reshape(-1)

    def _batch_inputs(self, prompts: list[list[int]],
                      mm_inputs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Left-padded ids and mask, plus every row's processor outputs (`mm_inputs`) concatenated in row order."""
        ids, mask = left_padded(prompts, self.pad_token_id)
        inputs = {"input_ids": ids, "attention_mask": mask}
        if self._mm_token_types:
            processor: Any = self.loaded.processor  # not None here (see __init__); typed for lists, takes the tensor
            inputs["mm_token_type_ids"] = torch.tensor(processor.create_mm_token_type_ids(ids))
        for key in dict.fromkeys(k for row in mm_inputs for k in row):
            value = concat_media(key, [row[key] for row in mm_inputs if key in row])
            inputs[key] = value.to(self.model.dtype) if value.is_floating_point() else value
        return {k: v.to(self.device) for k, v in inputs.items()}


def _failed_alone(job: _Job, err: Exception) -> EngineError:
    """The error of a request that failed in a batch of its own. A ValueError there is the request's: the model's
    or the sampler's check of its inputs (media that miss their placeholders, a number past a C type), so it is a
    `RequestError` (a 400 from `relax-gym serve`)."""
    kind = RequestError if isinstance(err, ValueError) else EngineError
    return kind(f"generation failed for request {job.request.rid!r}: {err!r}")


def _weight_problem(value: Any, target: torch.Tensor) -> str | None:
    """Why `value` cannot be copied into `target`: not a tensor, another shape, a dtype that is not the same
    kind (a float cast to another float is fine), or a value that is not finite. None if it can."""
    if not isinstance(value, torch.Tensor):
        return f"is a {type(value).__name__}, not a tensor"
    if value.shape != target.shape:
        return f"has shape {tuple(value.shape)}, the model's is {tuple(target.shape)}"
    if value.is_floating_point() != target.is_floating_point() or (
        not target.is_floating_point() and value.dtype != target.dtype
    ):
        return f"has dtype {value.dtype}, the model's is {target.dtype}"
    if value.is_floating_point() and not all_finite(value):
        return "holds NaN or infinite values"
    return None


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite. A NaN or an infinity makes the sum non-finite, so one reduction (no
    tensor-sized mask: ~50x faster on a CPU) settles the usual case; only a sum that overflows is checked
    element by element."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's *.safetensors shards (or of one .safetensors file)."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() and f.suffix == ".safetensors" for f in files):
        raise RequestError(f"update_weights: no *.safetensors at {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors
