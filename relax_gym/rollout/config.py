"""The rollout's own settings: what ends an episode (`RolloutLimits`), how many run at once, and the `rollout:`
section of a config (`RolloutConfig`) that `relax-gym rollout`, `relax-gym eval` and `relax-gym train` share. They
live in the rollout package, below the trainer, so the rollout never imports the trainer to read its settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relax_gym.engines.base import SamplingParams
from relax_gym.engines.embedded import MAX_BATCH_SIZE, Batching, engine_device
from relax_gym.engines.http_engine import OUTAGE_TIMEOUT_S
from relax_gym.web.address import is_loopback

#: episodes run at once by default (`rollout.concurrency` reads it here)
MAX_CONCURRENCY = 256


@dataclass(frozen=True)
class RolloutLimits:
    """What ends an episode besides its env. Its defaults are also `rollout.*`'s (`RolloutConfig` reads them here).

    `max_turns` is the run's budget of policy turns per episode; an env may have its own turn limit (e.g.
    `ToolEnv.max_turns`, the task's rule). Whichever is reached first ends the episode as `truncated`: the
    env's with the reason its info gives (`truncated_by`, `max_turns` for ToolEnv), this one with `max_turns`.
    """

    max_turns: int = 8
    max_total_tokens: int = 4096
    episode_timeout_s: float = 600.0
    check_rerender: bool = True


class StrictSection(BaseModel):
    """A config section: unknown keys are errors (a typo never passes silently), assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RolloutConfig(StrictSection):
    """`rollout:`, for `relax-gym train` and (`rollout.KEY=VALUE`) `relax-gym rollout` alike.

    Each default is written once: the sampling ones are `SamplingParams`' and the limits' `RolloutLimits`'
    (read from there), the others are here; `sampling_params()` and `limits()` build those two from this section.
    """

    engine: Literal["embedded", "sglang", "vllm"] = Field(
        "embedded",
        description="what generates: \"embedded\" (the transformers engine in this process), \"sglang\" (servers at "
        "engine_url or engine_urls: SGLang or `relax-gym serve`) or \"vllm\" (vLLM servers at engine_url or "
        "engine_urls, or, with neither, one the run starts on its model: `bash scripts/setup_vllm_venv.sh` installs "
        "it)",
    )
    engine_url: str | None = Field(None, description="the engine server's URL (engine: sglang or vllm)")
    engine_urls: list[str] | None = Field(None, description="several servers (`relax-gym serve` or SGLang) behind "
                                          "one `EngineRouter`: sticky episodes, failover on outage")
    engine_outage_timeout_s: float = Field(OUTAGE_TIMEOUT_S, gt=0, description="how long an unreachable engine "
                                           "server is waited for (retried with backoff) before the run stops (with "
                                           "`engine_urls`: how long the router waits for any live server)")
    group_size: int = Field(8, ge=1, description="episodes per task (the same env seed); advantages are relative "
                            "to the group, so training (but distill) needs 2 or more")
    groups_per_step: int = Field(8, ge=1, description="groups (tasks) each training step trains on")
    temperature: float = Field(SamplingParams.temperature, ge=0, description="the sampling temperature; 0 = "
                               "greedy, for `relax-gym rollout` only: training takes logprobs at this temperature, "
                               "so needs > 0")
    top_p: float = Field(SamplingParams.top_p, gt=0, le=1, description="nucleus sampling: the smallest set of "
                         "tokens whose probabilities reach this sum; 1 = off")
    top_k: int = Field(SamplingParams.top_k, ge=0, description="sample among the k likeliest tokens only; 0 = off")
    max_new_tokens: int = Field(SamplingParams.max_new_tokens, ge=1, description="tokens one generation (one "
                                "policy turn) may produce")
    max_turns: int = Field(RolloutLimits.max_turns, ge=1, description="the run's budget of policy turns per "
                           "episode; an env's own turn limit (e.g. ToolEnv's `max_turns` env kwarg) is the task's "
                           "rule. Whichever is reached first ends the episode as `truncated`")
    max_total_tokens: int = Field(RolloutLimits.max_total_tokens, ge=16, description="tokens of a whole episode "
                                  "(prompt, turns and observations); reaching it ends the episode as `truncated`")
    concurrency: int = Field(MAX_CONCURRENCY, ge=1, description="episodes run at once")
    episode_timeout_s: float = Field(RolloutLimits.episode_timeout_s, gt=0, description="wall-clock limit of one "
                                     "episode; past it the episode is aborted")
    engine_max_batch_size: int = Field(MAX_BATCH_SIZE, ge=1, description="batch size of the embedded engine; 1 "
                                       "makes generation independent of request timing")
    engine_batching: Batching = Field(
        "continuous",
        description="the embedded engine's batching: \"continuous\" (requests join a running batch; text-only models, "
        "others batch statically whatever this says) or \"static\" (one `generate` per batch, runs to its longest row)",
    )
    engine_device: str = Field("auto", description="where the embedded engine runs: \"auto\" (the first GPU if "
                               "torch sees one, else the CPU), \"cpu\", \"cuda\", \"cuda:N\"; on a GPU it serves "
                               "in bfloat16")
    engine_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="the embedded engine's weights: \"auto\" (bfloat16 on a GPU, the model's own on a CPU), "
        "\"float32\" or \"bfloat16\". bfloat16 on a CPU with AVX-512 BF16 decodes about twice as fast and "
        "costs a logprob gap to the float32 trainer (benchmarks/RESULTS.md); keep "
        "algorithm.recompute_old_logprobs on (and TIS) with it",
    )
    weight_sync: Literal["auto", "tensor", "disk"] = Field(
        "auto",
        description="how trained weights reach engine servers (`engine: sglang` or `vllm`, which takes disk only): "
        "\"tensor\" (the state dict through "
        "/update_weights_from_tensor, shared in memory with a server on this host: CUDA IPC or shared memory), "
        "\"disk\" (RUN_DIR/weights/vN, loaded by path), or \"auto\": tensor when every server URL is loopback",
    )

    @field_validator("engine_device")
    @classmethod
    def _device_here(cls, value: str) -> str:
        engine_device(value)
        return value

    @model_validator(mode="after")
    def _engine_named(self) -> RolloutConfig:
        if self.engine_url and self.engine_urls:
            raise ValueError("rollout.engine_url and rollout.engine_urls are mutually exclusive: set one")
        if self.engine == "sglang" and not (self.engine_url or self.engine_urls):
            raise ValueError("rollout.engine=sglang needs rollout.engine_url or rollout.engine_urls")
        if self.engine == "vllm" and self.weight_sync == "tensor":
            raise ValueError("rollout.weight_sync=tensor: vLLM 0.32 takes tensors only over NCCL or CUDA IPC (a GPU); "
                             "use disk (or auto)")
        return self

    def weights_as_tensors(self) -> bool:
        """Whether the loop sends engine servers a state dict rather than a folder (`weight_sync`)."""
        if self.engine == "vllm":
            return False  # a folder: see `relax_gym.engines.vllm`
        if self.weight_sync != "auto":
            return self.weight_sync == "tensor"
        urls = self.engine_urls or [self.engine_url or ""]
        return all(is_loopback(httpx.URL(url).host) for url in urls)

    def sampling_params(self) -> SamplingParams:
        """Every request's sampling (the manager seeds and budgets each one)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens)

    def limits(self) -> RolloutLimits:
        """What ends an episode besides its env."""
        return RolloutLimits(max_turns=self.max_turns, max_total_tokens=self.max_total_tokens,
                             episode_timeout_s=self.episode_timeout_s)
