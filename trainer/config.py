"""The training config: YAML + `key=value` overrides, validated by pydantic.

A misspelt or ill-typed key is an error that names the key's full path and
the closest valid key, before anything expensive starts.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from relax_gym.cpu.threads import ThreadPlacement, check_cores
from relax_gym.errors import StartupError
from relax_gym.models.lora import ALL_LINEAR, LoraSpec
from relax_gym.rollout.config import RolloutConfig, StrictSection
from relax_gym.trainer.algorithms import AlgorithmConfig
from relax_gym.trainer.cluster.config import ClusterSection


class ModelSection(StrictSection):
    """The policy model; `model: DIR` is shorthand for `model: {path: DIR}`."""

    path: str = Field("tiny", description="a local HF checkpoint folder (a run folder, its checkpoints/step_N or "
                      "latest too), a tiny config name (tiny, tiny-vl, tiny-audio, ...), a .gguf file or a folder "
                      "with one, or a hub id ORG/NAME[@REVISION]")
    chat_template: str | None = Field(None, description="a Jinja file that replaces the checkpoint's chat template, "
                                      "or a bundled one by name (\"chatml-tools\")")
    template_kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments every "
                                            "chat-template render gets, e.g. {enable_thinking: false}")
    tool_format: str = Field("auto", description="how tool calls are read from the model's text: auto (from the "
                             "tokenizer) or a format name (hermes, hermes-loose, llama3, mistral, deepseek, harmony)")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, str) else value


#: sections a bare value stands for, and the key it fills (`model: DIR` = `model: {path: DIR}`)
SHORTHANDS = {"model": "path"}


class EnvConfig(StrictSection):
    id: str = Field(description="the env: a registered id (e.g. relax/Arithmetic-v0), a file.py or module that "
                    "registers one, or file.py:NAME / module:NAME")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments the env is made with "
                                   "(e.g. {digits: 2})")
    eval_kwargs: dict[str, Any] = Field(default_factory=dict, description="kwargs for held-out evaluation (e.g. "
                                        "{split: test}); merged over `kwargs`")


class AlgorithmSection(AlgorithmConfig):
    """`algorithm:`: the loss's `AlgorithmConfig` (its fields, defaults, choices and checks; `algorithm` is
    spelled `name` here, as users' configs have it) plus two options of the train loop."""

    model_config = ConfigDict(frozen=False, validate_assignment=True, validate_by_name=False, serialize_by_alias=True)

    recompute_old_logprobs: bool = Field(True, description="recompute old logprobs with the trainer (ratio "
                                         "against them); else use the engine's")
    teacher: str | None = Field(None, description="a model (tiny name or folder) whose logprobs are the "
                                "distillation target (`name: distill` needs one)")
    routing_replay: bool = Field(False, description="rollout routing replay (R3) for MoE policies: the engine "
                                 "returns each token's routed experts, trajectories keep them, and the trainer's "
                                 "routers take them in every policy forward (reference and teacher route freely)")

    @property
    def name(self) -> str:
        """The algorithm, under its config key."""
        return self.algorithm

    def to_algorithm_config(self) -> AlgorithmConfig:
        """The loss's own (frozen) config, without the loop options."""
        return AlgorithmConfig.model_validate({k: getattr(self, k) for k in AlgorithmConfig.model_fields})


class RoleThreads(StrictSection):
    """One in-process role's thread: the cores it may run on and its torch thread count (unset: as the process)."""

    cores: list[int] | None = Field(None, min_length=1, description="the CPU cores (ids) the role's thread may run "
                                    "on; unset: the process's")
    threads: int | None = Field(None, ge=1, description="torch's thread count in the role's thread; unset: the "
                                "process's")

    @field_validator("cores")
    @classmethod
    def _cores_exist(cls, cores: list[int] | None) -> list[int] | None:
        if cores is not None:
            check_cores(cores)
        return cores

    def placement(self) -> ThreadPlacement:
        return ThreadPlacement(None if self.cores is None else tuple(self.cores), self.threads)


class CpuSection(StrictSection):
    """`cpu:`: cores and torch threads per role of a one-process run (the embedded engine's worker thread and
    the trainer's thread), so an async run's roles stop taking turns on the same cores."""

    engine: RoleThreads = Field(default_factory=RoleThreads, description="the embedded engine's worker thread")
    trainer: RoleThreads = Field(default_factory=RoleThreads, description="the thread every training-backend call "
                                 "runs in (with trainer.own_process: the backend's process)")


class MegatronSection(StrictSection):
    tp: int = Field(1, ge=1, description="tensor-parallel size: each layer split over this many ranks")
    pp: int = Field(1, ge=1, description="pipeline-parallel size: the layers split into this many stages")
    ep: int = Field(1, ge=1, description="expert parallelism of a mixture-of-experts model: its experts spread over "
                    "this many data-parallel ranks")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="parameters and forward: \"auto\" is bfloat16 on a GPU (float32 main params in the optimizer and "
        "the checkpoint), float32 on a CPU",
    )


class LoraSection(StrictSection):
    """`trainer.lora`: train a LoRA adapter (peft) instead of every weight (backend: torch)."""

    rank: int = Field(16, ge=1, description="the adapter's rank r: each adapted layer learns B @ A of this inner "
                      "size")
    alpha: int | None = Field(None, gt=0, description="the adapter's scale: its update is B @ A x alpha / rank; "
                                "absent, 2 x rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on each adapted layer's input while training")
    target_modules: str | list[str] = Field(
        ALL_LINEAR, description="the layers adapted, by leaf name (e.g. [q_proj, v_proj]), or \"all-linear\": "
        "every linear layer but the output head")

    def spec(self) -> LoraSpec:
        return LoraSpec(rank=self.rank, alpha=self.alpha, dropout=self.dropout, target_modules=self.target_modules)


class TrainerSection(StrictSection):
    backend: Literal["torch", "megatron"] = Field(
        "torch",
        description="what trains the policy: \"torch\" (the transformers model in one process) or \"megatron\" "
        "(megatron-core with TP / PP / DP, see trainer.megatron)",
    )
    mode: Literal["sync", "async"] = Field(
        "async",
        description="\"sync\": generate a step's groups, train, push weights, repeat (on-policy); \"async\": rollouts "
        "run ahead of the trainer by at most max_staleness weight versions",
    )
    max_staleness: int = Field(1, ge=0, description="how many weight versions the rollouts may run ahead of the "
                               "trainer (async); 0 reproduces the sync run's batches, and mode: sync needs 0")
    total_steps: int = Field(100, ge=1, description="optimizer steps the run trains (a resumed run continues to "
                             "this many)")
    lr: float = Field(1e-5, gt=0, description="the optimizer's (Adam's) learning rate, constant over the run")
    weight_decay: float = Field(0.0, ge=0, description="the optimizer's (decoupled) weight decay")
    grad_clip: float = Field(1.0, gt=0, description="the largest gradient norm: each step's gradients are "
                             "clipped to it")
    micro_batch_tokens: int = Field(4096, ge=16, description="padded tokens (samples x longest sample) per "
                                    "micro-batch of a step; a longer sample gets a micro-batch of its own")
    gradient_checkpointing: bool = Field(False, description="keep only each layer's input for the backward and run "
                                         "its forward again there (backend: torch): activations a few percent of "
                                         "their size, for about a quarter more compute (benchmarks/RESULTS.md)")
    checkpoint_every: int = Field(20, ge=1, description="a checkpoint every this many steps (and after the last)")
    keep_checkpoints: int = Field(3, ge=1, description="step folders kept under checkpoints/ (the newest ones); "
                                  "each holds the weights and the optimizer state, about 12 bytes a parameter in "
                                  "fp32 (1.6 GB for a 135M model): the run says the size at its first save")
    eval_every: int = Field(0, ge=0, description="a held-out eval every this many steps (in the background); "
                            "0: none")
    eval_tasks: int = Field(32, ge=1, description="held-out tasks per env in each eval (seeds disjoint from "
                            "training's, with the env's eval_kwargs)")
    eval_samples: int = Field(1, ge=1, description="held-out episodes per task: 1 with greedy decoding (as "
                              "`relax-gym eval` runs) by default; several at the training temperature measure the "
                              "policy RL trains (pass@1 is then the mean over the samples)")
    eval_temperature: float = Field(0.0, ge=0, description="the held-out episodes' sampling temperature; 0: greedy "
                                    "(one sample per task)")
    eval_at_start: bool = Field(True, description="with eval_every: one eval of the starting model before the "
                                "first step (step 0), so the run's own rows hold its before and after (a resumed "
                                "run has it already)")
    max_steps_without_samples: int = Field(3, ge=1, description="the run stops (exit 1, with the episodes' "
                                           "statuses and reasons) after this many steps in a row with no trainable "
                                           "sample: such a run cannot learn")
    resume: Literal["auto", "never"] = Field(
        "auto",
        description="auto: continue from run_dir's latest checkpoint, saying so; never: refuse a run_dir that has one",
    )
    own_process: bool = Field(False, description="run the backend in a child process of its own "
                              "(`trainer.backends.process`): its Python then runs beside the rollout's instead of "
                              "sharing one GIL with it, which an async run of a small model needs to overlap")
    megatron: MegatronSection = Field(default_factory=MegatronSection, description="the Megatron backend's "
                                      "parallelism and dtype (backend: megatron)")
    lora: LoraSection | None = Field(None, description="train a LoRA adapter and freeze the base (backend: "
                                     "torch): checkpoints are PEFT adapter folders, engines get the merged layers; "
                                     "absent, every weight trains")

    def served_adapters(self) -> tuple[int, int] | None:
        """(rank, adapters kept) on a server that loads the run's LoRA adapters by name: `max_staleness + 1` kept, so
        a request of the oldest version a step may still train finishes on its own adapter; None without `lora`."""
        return (self.lora.rank, self.max_staleness + 1) if self.lora is not None else None


class TrainConfig(StrictSection):
    run_dir: str = Field("runs/default", description="the run's folder: its config.yaml, metrics.jsonl, "
                         "trajectories, TensorBoard events and checkpoints/")
    seed: int = Field(0, description="the run's seed: torch's, the training tasks' env seeds and their requests' "
                      "sampling seeds derive from it")
    model: ModelSection = Field(default_factory=ModelSection, description="the policy model; `model: DIR` is "
                                "shorthand for `model: {path: DIR}`")
    envs: list[EnvConfig] = Field(description="the envs trained on (required): training task n plays "
                                  "envs[n mod len(envs)]; each eval runs every one")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="the episodes: engine, sampling, "
                                   "group sizes and limits (shared with `relax-gym rollout` and `relax-gym eval`)")
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection, description="the RL algorithm: policy "
                                        "loss, off-policy corrections, KL and entropy terms, advantages")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="the training backend, schedule, "
                                    "optimizer, checkpoints and evals")
    cpu: CpuSection = Field(default_factory=CpuSection, description="cores and torch threads per role of a "
                            "one-process run (the embedded engine's worker thread and the trainer's thread), so an "
                            "async run's roles stop taking turns on the same cores")
    cluster: ClusterSection | None = Field(None, description="roles as Ray actors; absent (the default), the run "
                                           "is one process and never imports Ray")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        """Combinations that cannot mean what they say are errors, not silent rewrites."""
        if self.trainer.mode == "sync" and self.trainer.max_staleness != 0:
            if "max_staleness" in self.trainer.model_fields_set:
                raise ValueError(f"trainer.mode=sync is on-policy: trainer.max_staleness must be 0, got "
                                 f"{self.trainer.max_staleness} (use trainer.mode=async for off-policy steps)")
            self.trainer.max_staleness = 0  # the default (1) is async's; sync is on-policy by definition
        if self.rollout.temperature == 0:
            raise ValueError("rollout.temperature=0 is greedy decoding, which cannot be trained on (the trainer "
                             "takes logprobs at the rollout temperature); use rollout.temperature > 0")
        if self.trainer.eval_samples > 1 and self.trainer.eval_temperature == 0:
            raise ValueError(f"trainer.eval_samples={self.trainer.eval_samples} at trainer.eval_temperature=0 is "
                             "one greedy answer repeated; set trainer.eval_temperature > 0 (e.g. the rollout's)")
        if self.trainer.own_process and self.cluster is not None:
            raise ValueError("trainer.own_process with a cluster: section: a cluster run's trainer is already a "
                             "process of its own (a Ray actor); drop trainer.own_process")
        if self.algorithm.name == "distill" and not self.algorithm.teacher:
            raise ValueError("algorithm.name=distill needs algorithm.teacher")
        if self.trainer.lora is not None and self.trainer.backend != "torch":
            raise ValueError(f"trainer.lora needs trainer.backend=torch: the {self.trainer.backend} backend trains "
                             "full weights only")
        if self.cluster is not None and self.cluster.trainer.world_size > 1 and self.trainer.backend != "megatron":
            raise ValueError(f"cluster.trainer.world_size={self.cluster.trainer.world_size} needs "
                             "trainer.backend=megatron: the torch backend trains in one process")
        if self.algorithm.name != "distill" and self.rollout.group_size < 2:
            raise ValueError(f"rollout.group_size=1 with algorithm.name={self.algorithm.name}: advantages are "
                             "relative to the task's group, so every one would be 0 and nothing would be learnt; "
                             "use rollout.group_size >= 2")
        return self


class ConfigError(StartupError):
    """The config file or an override is wrong; the message names the key."""


def _keys(model: type[BaseModel]) -> dict[str, Any]:
    """A section's fields under the keys a config spells them with (an alias where it has one)."""
    return {field.alias or name: field for name, field in model.model_fields.items()}


def _model_at(path: tuple[Any, ...]) -> type[BaseModel] | None:
    model: Any = TrainConfig
    for part in path:
        if isinstance(part, int):
            continue
        field = _keys(model).get(part)
        if field is None:
            return None
        annotation = field.annotation
        inner = getattr(annotation, "__args__", None)
        model = inner[0] if inner and isinstance(inner[0], type) and issubclass(inner[0], BaseModel) else annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
    return model


def _explain(err: ValidationError) -> str:
    """One line per problem, each naming the key's full path (and, for an unknown key, the closest valid one)."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "config"
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            valid = list(_keys(parent)) if parent else []
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            prefix = ".".join(str(p) for p in loc[:-1])
            hint = f" Did you mean {(prefix + '.' if prefix else '') + close[0]!r}?" if close else ""
            lines.append(f"unknown key {key!r}.{hint} Valid keys here: {', '.join(valid)}")
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):
            lines.append(str(e["ctx"]["error"]))  # a whole-section check: its message names the keys
        else:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r:.200})")
    return "invalid config:\n  " + "\n  ".join(lines)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node: Any = tree
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[int(part)]
            continue
        nxt = node.setdefault(part, {})
        if i == 0 and part in SHORTHANDS and isinstance(nxt, str):
            nxt = node[part] = {SHORTHANDS[part]: nxt}
        if not isinstance(nxt, dict | list):
            raise ConfigError(f"override {dotted!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = nxt
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    elif node is tree and last in SHORTHANDS and isinstance(node.get(last), dict) and not isinstance(value, dict):
        node[last][SHORTHANDS[last]] = value  # `model=DIR` after `model.chat_template=...` keeps the template
    else:
        node[last] = value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Reads YAML, applies `a.b.c=value` overrides (values parsed as YAML), validates."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            tree = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as err:
            raise ConfigError(f"{p}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
                              "save the config as UTF-8 YAML") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{p}: not valid YAML: {err}") from None
        except OSError as err:
            raise ConfigError(f"config file {p}: cannot read it: {err.strerror}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level")
    _apply_overrides(tree, overrides)
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def _apply_overrides(tree: dict[str, Any], overrides: Sequence[str]) -> None:
    """Sets each `a.b.c=value` (the value parsed as YAML) in `tree`, in order."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        try:
            _set_dotted(tree, key.strip(), yaml.safe_load(raw))
        except (yaml.YAMLError, ValueError, IndexError, KeyError) as err:
            raise ConfigError(f"override {item!r}: {type(err).__name__}: {err}") from None


class _RolloutOnly(StrictSection):
    """A config of only the `rollout:` section, so its errors read as in a full config."""

    rollout: RolloutConfig = Field(default_factory=RolloutConfig)


def load_rollout_config(given: dict[str, Any], overrides: Sequence[str] = ()) -> RolloutConfig:
    """The `rollout:` section from `given` fields (what `relax-gym rollout`'s flags set) with `rollout.KEY=VALUE`
    overrides applied after them, validated and explained as `load_config` does for a training config."""
    for item in overrides:
        if not item.strip().startswith("rollout."):
            raise ConfigError(f"setting {item!r}: relax-gym rollout takes rollout.KEY=VALUE settings (the rollout "
                              f"section of a training config; valid keys: {', '.join(_keys(RolloutConfig))})")
    tree: dict[str, Any] = {"rollout": dict(given)}
    _apply_overrides(tree, overrides)
    try:
        return _RolloutOnly.model_validate(tree).rollout
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None
