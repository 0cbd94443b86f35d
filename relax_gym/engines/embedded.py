"""The embedded engine: a transformers model in-process, batching concurrent requests.

One worker thread owns the model. `generate()` calls queue jobs (`request_queue`), so the event loop never runs
torch code and concurrent episodes share forward passes. Text models batch continuously (`continuous_scheduler`);
models with a processor, and `batching="static"`, run one `model.generate` per batch (`static_scheduler`, over
`hf_generation`). This class builds those parts around one model and answers the `Engine` protocol with them.

Media placeholder tokens (`<|image_pad|>`, `<|AUDIO|>`, ...) are never sampled:
one in an output has no features behind it, and the trainer's forward over the
trajectory then fails ("Image features and image tokens do not match", a known
crash of RL stacks whose engines allow it). Like top-k / top-p, this shapes
only the choice; logprobs stay log softmax(logits / T) over the full vocabulary.

The worker applies weight updates (`model_weights`) between batches (under continuous batching,
once the running rows have finished, admitting none meanwhile), so each output
comes from one version; being the only thread that touches the model, it needs
no lock around it.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from relax_gym.cpu.decode_attention import use_decode_attention
from relax_gym.cpu.onednn_linear import use_onednn_linears
from relax_gym.cpu.process import prepare_process
from relax_gym.cpu.threads import ThreadPlacement, release_openmp_workers
from relax_gym.engines.base import GenerateOutput, GenerateRequest, RequestError
from relax_gym.engines.continuous import supports_continuous_batching
from relax_gym.engines.continuous_scheduler import ContinuousScheduler
from relax_gym.engines.hf_generation import BatchInputs
from relax_gym.engines.model_weights import ModelWeights
from relax_gym.engines.request_queue import AdapterChange, Job, RequestQueue, Update, end_unstarted
from relax_gym.engines.resident_adapters import ResidentAdapters
from relax_gym.engines.static_scheduler import StaticScheduler
from relax_gym.models import LoadedModel, encode_media
from relax_gym.models.moe_routing import routers
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
        inputs = BatchInputs(loaded, self.pad_token_id, self.device)
        #: whether requests join a running batch (`relax_gym.engines.continuous`): asked for, and the model allows
        self.continuous = batching == "continuous" and supports_continuous_batching(
            self.model, loaded.processor is not None
        )
        if self.continuous and self.device.type == "cpu":
            use_decode_attention(self.model)
        #: LoRA adapters loaded by name, which requests name (`GenerateRequest.adapter`); none at first
        self.adapters = ResidentAdapters(self.model)
        self._queue = RequestQueue(loaded.name, max_batch_size=max_batch_size, batch_window_s=batch_window_s)
        self._weights = ModelWeights(self.model, loaded.name, self.adapters)
        self._processor_lock = threading.Lock()
        scheduler = ContinuousScheduler if self.continuous else StaticScheduler
        self._scheduler = scheduler(
            queue=self._queue, weights=self._weights, inputs=inputs, model=self.model, adapters=self.adapters,
            device=self.device, generator=self._generator, eos_token_ids=self.eos_token_ids,
            never=self.placeholder_token_ids, decode=loaded.decode, pad_token_id=self.pad_token_id,
            placement=placement or ThreadPlacement(),
        )
        self._worker = threading.Thread(target=self._scheduler.run, name="relax-gym-embedded-engine", daemon=True)
        self._worker.start()
        release_openmp_workers()  # this thread's, from loading the model: the worker computes from here

    # --- the Engine protocol ---------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weights.version

    @property
    def paused(self) -> bool:
        return self._queue.paused

    async def generate(self, request: GenerateRequest, *, timeout_s: float | None = None) -> GenerateOutput:
        """`timeout_s` bounds the wait: past it the request ends with finish_reason "abort" and the tokens
        it has so far (none if it was still queued). Cancelling the call drops the request at its next step."""
        self._queue.check_open()
        self._validate(request)
        if request.sampling.max_new_tokens == 0:
            return GenerateOutput([], [], "length", self._weights.version, len(request.input_ids))
        mm_inputs = await self._mm_inputs(request)
        loop = asyncio.get_running_loop()
        job = Job(request, mm_inputs, loop.create_future(), loop)
        self._queue.put(job)
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
        self._queue.check_open()
        if isinstance(version, bool) or not isinstance(version, int):
            raise RequestError(f"update_weights: version must be an int, got {version!r}")
        tensors = await asyncio.to_thread(self._weights.checked, weights)
        loop = asyncio.get_running_loop()
        await self._queue.put_update(Update(tensors, version, loop.create_future(), loop))

    async def load_adapter(self, name: str, folder: str | os.PathLike[str]) -> None:
        """Loads the PEFT adapter folder as `name`, for the requests that name it; the base and other adapters
        stay as they are. Applied between batches, as weight updates are."""
        await self._change_adapters(functools.partial(self.adapters.load, name, folder))

    async def unload_adapter(self, name: str) -> None:
        """Unloads adapter `name` between batches; queued requests naming it then fail."""
        await self._change_adapters(functools.partial(self.adapters.unload, name))

    async def _change_adapters(self, change: Callable[[], None]) -> None:
        self._queue.check_open()
        loop = asyncio.get_running_loop()
        await self._queue.put_update(AdapterChange(change, loop.create_future(), loop))

    async def pause(self, *, abort: bool = False) -> None:
        """Returns once the running batch (if any) has finished; requests that arrive meanwhile wait for
        `resume`. `abort=True` is SGLang's abort mode: running requests end at their next step with
        finish_reason "abort" and the tokens they have, queued ones at once with none."""
        end_unstarted(self._queue.pause(abort=abort), self._weights.version)
        await asyncio.to_thread(self._queue.wait_idle)

    @property
    def busy(self) -> bool:
        """Whether requests are running, taken and not yet answered (SGLang's `/flush_cache` is refused then).
        A request leaves before its answer is sent, so its caller never finds the engine busy with it."""
        return self._queue.running.count > 0

    async def resume(self) -> None:
        self._queue.resume()

    async def connect(self) -> dict[str, Any]:
        """In-process: ready once built."""
        return {"model_path": self.loaded.name}

    async def health(self) -> bool:
        return not self._queue.closed and self._worker.is_alive()

    async def close(self) -> None:
        """Stops the worker: the running batch ends with finish_reason "abort" at its next step,
        queued requests get "abort" outputs, pending weight updates an EngineError."""
        self._queue.close()
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

    def _abort(self, job: Job) -> None:
        """Ends `job`: at once if it is still queued, else at its batch's next step (`RequestQueue.ends`)."""
        if self._queue.abort(job):
            end_unstarted([job], self._weights.version)

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
