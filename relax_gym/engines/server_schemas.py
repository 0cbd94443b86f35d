"""The bodies `relax-gym serve`'s SGLang-native routes take, as pydantic models: a request is checked whole, and
refused with a 400 naming its field, before it costs the server more than its body."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

from relax_gym.engines.base import SamplingParams

#: the bound of every count a request gives (a vocabulary, a token budget): what a 32-bit field holds
MAX_INT32 = 2**31 - 1

# SGLang sampling params accepted only at their neutral value: anything else would be silently ignored.
NEUTRAL_SAMPLING = {
    "n": 1,
    "min_new_tokens": 0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "min_p": 0.0,
    "ignore_eos": False,
    "spaces_between_special_tokens": True,
}
MAX_STOPS = 32
MAX_STOP_CHARS = 256


class BadRequest(ValueError):
    """A request field that cannot be used; answered with 400 and this message."""


def _utf8(value: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"), which no tokenizer or encoder takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"not valid UTF-8 text (a lone surrogate at position {err.start})") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]


class SamplingIn(BaseModel):
    """SGLang's sampling params. Counts and flags are strict (`true` is not 1, `"5"` is not 5): a client that
    sends the wrong type hears so instead of being read as it did not mean."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    temperature: StrictFloat = Field(1.0, ge=0)
    top_p: StrictFloat = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(-1, ge=-1, le=MAX_INT32)
    max_new_tokens: StrictInt = Field(128, ge=0, le=MAX_INT32)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=1024)
    skip_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    sampling_seed: StrictInt | None = Field(None, ge=0, lt=2**63)

    @model_validator(mode="after")
    def _only_neutral_extras(self) -> SamplingIn:
        for name, value in (self.model_extra or {}).items():
            if name not in NEUTRAL_SAMPLING:
                raise ValueError(f"unknown sampling parameter {name!r}")
            if value != NEUTRAL_SAMPLING[name]:
                raise ValueError(f"{name}={value!r} is not supported (only {NEUTRAL_SAMPLING[name]!r})")
        stops = listed(self.stop)
        if len(stops) > MAX_STOPS or any(not 0 < len(x) <= MAX_STOP_CHARS for x in stops):
            raise ValueError(f"stop: at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} characters")
        return self

    def to_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            max_new_tokens=self.max_new_tokens,
            stop=tuple(listed(self.stop)),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            seed=self.sampling_seed,
        )


class GenerateIn(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    text: Text | None = None
    input_ids: list[StrictInt] | None = None
    image_data: str | list[str] | None = None
    audio_data: str | list[str] | None = None
    video_data: str | list[str] | None = None
    sampling_params: SamplingIn = Field(default_factory=SamplingIn)
    return_logprob: StrictBool = False
    logprob_start_len: StrictInt = -1
    rid: Annotated[Text, Field(max_length=256)] | None = None
    stream: StrictBool = False
    return_routed_experts: StrictBool = False
    #: SGLang's: the name of a loaded LoRA adapter to run on (`/load_lora_adapter`); None: the base
    lora_path: Annotated[Text, Field(max_length=256)] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateIn:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if self.stream:
            raise ValueError("stream=true is not supported by this server")
        return self


class UpdateIn(BaseModel):
    """What every weight update takes."""

    weight_version: int | Text | None = None
    flush_cache: bool = True


class UpdateOptionsIn(UpdateIn):
    """SGLang's further options of the tensor and distributed updates, accepted at their defaults only."""

    abort_all_requests: bool = False
    load_format: Text | None = None

    @model_validator(mode="after")
    def _defaults_only(self) -> UpdateOptionsIn:
        if self.load_format is not None:
            raise ValueError(f"load_format: only the default (SGLang's flattened buckets are not read), got "
                             f"{self.load_format!r}")
        if self.abort_all_requests:
            raise ValueError("abort_all_requests: only false (pause the server first; the running batch finishes "
                             "before the update)")
        return self


class UpdateFromDiskIn(UpdateIn):
    model_path: Text


class LoadAdapterIn(BaseModel):
    """SGLang's `/load_lora_adapter`: a PEFT adapter folder on the server's disk, loaded under `lora_name`."""

    lora_name: Annotated[Text, Field(min_length=1, max_length=256)]
    lora_path: Text
    #: SGLang keeps a pinned adapter in GPU memory; every adapter here is resident, so it is accepted and moot
    pinned: StrictBool = False


class UnloadAdapterIn(BaseModel):
    lora_name: Annotated[Text, Field(min_length=1, max_length=256)]


class UpdateFromTensorIn(UpdateOptionsIn):
    safetensors_b64: str | None = None
    #: SGLang's: one entry per tensor-parallel rank (this server is one rank), `tensor_ipc`'s pickles
    serialized_named_tensors: list[str] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_payload(self) -> UpdateFromTensorIn:
        if (self.safetensors_b64 is None) == (self.serialized_named_tensors is None):
            raise ValueError("give exactly one of serialized_named_tensors (SGLang's: tensors shared on this host) "
                             "and safetensors_b64 (base64 of a safetensors file of {name: tensor})")
        return self


GroupName = Annotated[Text, Field(min_length=1, max_length=256)]
#: SGLang's default group name, used when a body names none
DEFAULT_GROUP = "weight_update_group"


class InitGroupIn(BaseModel):
    master_address: Annotated[Text, Field(min_length=1, max_length=256)]
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: GroupName = DEFAULT_GROUP
    backend: Text = "nccl"

    @model_validator(mode="after")
    def _rank_in_group(self) -> InitGroupIn:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset: {self.rank_offset} is not a rank of a group of {self.world_size} "
                             "(rank 0 is the trainer)")
        return self


class UpdateFromDistributedIn(UpdateOptionsIn):
    names: list[Text] = Field(min_length=1)
    dtypes: list[Text]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    group_name: GroupName = DEFAULT_GROUP

    @model_validator(mode="after")
    def _aligned(self) -> UpdateFromDistributedIn:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names, dtypes, shapes: {len(self.names)}, {len(self.dtypes)} and {len(self.shapes)} "
                             "items; one of each per tensor")
        if len(set(self.names)) != len(self.names):
            raise ValueError("names: a name is listed twice")
        return self


class DestroyGroupIn(BaseModel):
    group_name: GroupName = DEFAULT_GROUP


class PauseIn(BaseModel):
    mode: Literal["abort", "in_place", "retract"] = "abort"


class BeginWeightUpdateIn(BaseModel):
    """SGLang 0.5.21+'s /begin_weight_update body: which model's weights (this server has only the target)."""

    selector: Literal["target", "all"] = "all"



def listed(value: str | list[str] | None) -> list[str]:
    """A field that takes one item or a list of them, as a list."""
    return [value] if isinstance(value, str) else list(value or [])
