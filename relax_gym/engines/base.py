"""The engine protocol: token ids in, token ids with logprobs out.

The rollout manager owns tokenization and the chat template; an engine only
continues a token sequence. Two implementations: the embedded transformers
engine (in-process) and an httpx client of SGLang's native HTTP API. Both
report the policy version of the weights that produced the tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
from PIL import Image

from relax_gym.video import Video
from relax_gym.web.keys import ENGINE_KEY_ENV

FinishReason = Literal["stop", "length", "abort"]


#: the environment variable `relax-gym serve` and `SGLangEngine` read the engine's key from (`relax_gym.web.keys`)
API_KEY_ENV = ENGINE_KEY_ENV


class EngineError(RuntimeError):
    """The engine failed or is unreachable; the message says which and where."""


class RequestError(EngineError):
    """The request itself is invalid (the message names the field): retrying it cannot help."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        #: the HTTP status a server answered with, where one did (a 404 tells an older server's route names)
        self.status = status


def check_fits(prompt: int, max_new_tokens: int, context: int, prompt_field: str,
               max_field: str = "sampling_params.max_new_tokens") -> None:
    """SGLang's rule: the prompt and the tokens asked for must fit in the model's context; RequestError naming the
    field that does not (`/generate` and the chat route both ask it before any prefill)."""
    if prompt >= context:
        raise RequestError(f"{prompt_field}: the prompt has {prompt} tokens, the model's context is {context}")
    if prompt + max_new_tokens > context:
        raise RequestError(f"{max_field}: {max_new_tokens} does not fit: the prompt has {prompt} tokens and the "
                           f"model's context is {context}, so at most {context - prompt}")


class EngineUnavailableError(EngineError):
    """The server stayed unreachable (or 502/503/504) for the whole outage budget: an outage, not a bad answer."""


class EngineGoneError(EngineUnavailableError):
    """The engine's process is gone (killed, crashed, removed): another engine may take the request."""


#: seeds as every engine takes them: SGLang 0.5.6's sampler holds `sampling_seed` in an int32, so the rollout
#: manager draws 31-bit seeds and the SGLang client sends the low 31 bits of any other
SGLANG_SEED_MASK = 2**31 - 1


def request_seed(*key: object) -> int:
    """A 31-bit request seed drawn from `key` (a run's sampling seed, a task seed, a member of its group, a turn),
    so a run's samples depend on which request it is, never on request timing or batching."""
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=4).digest()
    return int.from_bytes(digest) & SGLANG_SEED_MASK


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Its defaults are also `rollout.*`'s (`RolloutConfig` reads them here)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    #: a per-request seed makes the request's samples independent of what it is batched with
    seed: int | None = None

    def to_sglang(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k if self.top_k > 0 else -1,
            "max_new_tokens": self.max_new_tokens,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            params["sampling_seed"] = self.seed & SGLANG_SEED_MASK
        return params


@dataclass
class GenerateRequest:
    """One continuation. `input_ids` already hold the expanded image/audio placeholder tokens.

    `images` / `audios` / `videos` are every image, audio clip and video of the
    conversation so far, each in order; `mm_inputs` are the matching processor
    outputs (pixel_values, image_grid_thw, input_features, pixel_values_videos, ...)
    when the caller already computed them, so the embedded engine need not run the
    processor again.
    """

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    images: list[Image.Image] = field(default_factory=list)
    audios: list[tuple[np.ndarray, int]] = field(default_factory=list)
    mm_inputs: dict[str, Any] | None = None
    rid: str | None = None
    #: SGLang's `return_routed_experts`: the output carries the experts each MoE layer routed every token to
    return_routed_experts: bool = False
    videos: list[Video] = field(default_factory=list)
    #: the LoRA adapter the request runs on, by the name it was loaded under (SGLang's `lora_path`, vLLM's
    #: `model`); None: the base weights, or the weights the engine was last pushed
    adapter: str | None = None


@dataclass
class GenerateOutput:
    output_ids: list[int]
    #: log p(token) under softmax(logits / temperature), untruncated by top-p/top-k,
    #: which is what the trainer recomputes at the rollout temperature.
    logprobs: list[float]
    finish_reason: FinishReason
    #: the version of the weights that generated the output (its last token's, if `token_versions` differ)
    weight_version: int
    prompt_tokens: int = 0
    #: each output token's version, where a weight update fell within the output (a request that a pause
    #: aborted and the client resumed); None: every token's is `weight_version`
    token_versions: list[int] | None = None
    #: with `return_routed_experts`, as SGLang returns them: int32 expert indices laid out [token, layer, top_k]
    #: (flat) for the tokens the model ran, positions 0 .. prompt + output - 2 (the last output token never ran)
    routed_experts: np.ndarray | None = None

    def versions(self) -> list[int]:
        """The version of each output token."""
        return list(self.token_versions) if self.token_versions is not None else (
            [self.weight_version] * len(self.output_ids))


@runtime_checkable
class Engine(Protocol):
    @property
    def weight_version(self) -> int: ...

    async def generate(self, request: GenerateRequest) -> GenerateOutput: ...

    async def update_weights(self, weights: Any, version: int) -> None:
        """Loads new weights (a state dict, or a path to an HF folder) and sets the version."""

    async def pause(self) -> None:
        """Stops starting new generations (running ones finish) until `resume`."""

    async def resume(self) -> None: ...

    async def connect(self) -> dict[str, Any]:
        """Makes the engine ready to serve (waits for a server and resumes it if a killed run left it paused);
        returns what it knows of its model."""

    async def health(self) -> bool: ...

    async def close(self) -> None: ...
