"""`cluster:`, the training config's section for the distributed run (absent: the run is one process).

Plain pydantic, no Ray import: the config is validated before anything is started, and an in-process run
reads it only to see that it is absent.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, model_validator

#: Ray custom resources, as a node announces them (`ray start --resources='{"trainer_box": 1}'`)
CustomResources = dict[str, PositiveFloat]
#: what a role reserves through its own fields (num_cpus, num_gpus), or Ray keeps for itself: never custom
_NOT_CUSTOM = ("CPU", "GPU", "memory", "object_store_memory")
_RESOURCES = ("Ray custom resources each actor reserves (a node announces them with `ray start --resources`): "
              "keeps the role on the nodes that have them, e.g. {trainer_box: 1}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EnginesSection(_Strict):
    """The inference engines, one Ray actor each (the embedded transformers engine inside).

    `kind: embedded` serves rollout workers through actor calls; `kind: serve` has each actor serve SGLang's
    native HTTP routes (`relax-gym serve`'s app), which workers call as they would an SGLang server; `kind: sglang`
    has each actor start an SGLang server (`python -m sglang.launch_server`, or `launch`) on its GPUs; `kind: vllm`
    a vLLM server (`relax_gym.engines.vllm.launch_vllm_server`, `args` added to its flags)."""

    kind: Literal["embedded", "serve", "sglang", "vllm"] = Field(
        "embedded",
        description="how engine actors serve: \"embedded\" (actor calls), \"serve\" (SGLang's HTTP routes, `relax-gym "
        "serve`'s app), \"sglang\" (an SGLang server each actor starts on its GPUs) or \"vllm\" (a vLLM server each "
        "actor starts, as `rollout.engine: vllm` does; servers registered by URL are then vLLM too)",
    )
    launch: list[str] | None = Field(None, description="`kind: sglang`: the command that replaces `python -m "
                                     "sglang.launch_server` (a wrapper, a container); it is given SGLang's arguments "
                                     "(--model-path, --host, --port, --tp-size, --api-key, then `args`)")
    args: list[str] = Field(default_factory=list, description="`kind: sglang` or `vllm`: more arguments for the "
                            "server, e.g. [--mem-fraction-static, \"0.8\"]")
    host: str | None = Field(None, description="where a served engine listens: default loopback on a local "
                             "cluster, the node's address on a joined one")
    count: int = Field(2, ge=1, description="engine actors started with the run (the control API scales them)")
    num_cpus: float = Field(0.5, ge=0, description="Ray CPUs each engine actor reserves")
    num_gpus: float = Field(0, ge=0, description="GPUs of each of the engine's `tp` ranks (the engine reserves "
                            "num_gpus x tp, on one node)")
    tp: int = Field(1, ge=1, description="the engine's tensor-parallel size")
    resources: CustomResources = Field(default_factory=dict, description=_RESOURCES)


class WorkersSection(_Strict):
    """Rollout workers: each runs a rollout manager, its env pools and an engine router."""

    count: int = Field(1, ge=1, description="rollout worker actors")
    num_cpus: float = Field(0.5, ge=0, description="Ray CPUs each worker actor reserves")
    resources: CustomResources = Field(default_factory=dict, description=_RESOURCES)


class TrainerRanksSection(_Strict):
    """The trainer's ranks, as Ray actors in one PACKed placement group (torchrun's job, done by Ray)."""

    world_size: int = Field(1, ge=1, description="ranks: 1 for the torch backend; Megatron's TP x PP x DP")
    num_cpus: float = Field(0.5, ge=0, description="Ray CPUs each rank reserves")
    num_gpus: float = Field(0, ge=0, description="GPUs of each rank")
    resources: CustomResources = Field(default_factory=dict, description=_RESOURCES)


class HealthSection(_Strict):
    """How the controller finds failures and how much recovery it spends on them."""

    poll_s: float = Field(2.0, gt=0, description="how often engines and workers are polled for progress")
    stall_s: float = Field(120.0, gt=0, description="a role with work in flight and no completion for this long is "
                           "stalled (probed, then replaced)")
    probe_timeout_s: float = Field(30.0, gt=0, description="how long a serving engine's one-token probe may take "
                                   "(a starting one's first token has the start's 300 s)")
    engine_restarts: int = Field(3, ge=0, description="recreations of one engine allowed per `restart_window_s`; "
                                 "past that it stays dead")
    worker_restarts: int = Field(3, ge=0, description="recreations of one rollout worker allowed per "
                                 "`restart_window_s`; past that it stays dead")
    restart_window_s: float = Field(600.0, gt=0, description="the window engine_restarts and worker_restarts "
                                    "count in")
    max_trainer_restarts: int = Field(3, ge=0, description="trainer restarts from the last checkpoint for the "
                                      "whole run; one more failure stops the run")
    trainer_stall_s: float = Field(1800.0, gt=0, description="a trainer call (a step, a checkpoint, the weights) "
                                   "that has not answered for this long is a lost trainer")
    min_engines: int = Field(1, ge=1, description="scale-in never goes below this many engines")
    max_kill_fraction: float = Field(0.25, gt=0, le=1, description="at most this fraction of the engines is "
                                     "replaced in one round; if more than half fail at once, none is")
    engine_wait_s: float = Field(300.0, gt=0, description="how long an episode waits for a live engine before it "
                                 "is aborted (\"no live engine\")")


class ControlSection(_Strict):
    """The elastic-rollout control API (HTTP, bearer token)."""

    enabled: bool = Field(True, description="serve the control API while the run trains")
    host: str = Field("127.0.0.1", description="the address the API listens on; beyond loopback the token "
                      "crosses the network in clear (put TLS or an SSH tunnel in front)")
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port; the URL is written to "
                      "RUN_DIR/control.json")
    token: str | None = Field(None, description="the bearer token; else $RELAX_GYM_CONTROL_TOKEN, else one "
                              "generated into RUN_DIR/control_token (0600)")
    max_engines: int = Field(64, ge=1, le=1024, description="scale-out never goes above this many engines, so a "
                             "typo or a stolen token cannot start hundreds")


class ClusterSection(_Strict):
    """Roles as Ray actors: `mode: ray` starts a local Ray cluster, or joins `address` (`auto`: the one
    `ray start` runs on this node)."""

    mode: Literal["ray"] = Field("ray", description="ray (the only kind): start a local Ray cluster, or join "
                                 "`address`")
    address: str | None = Field(None, description="a Ray cluster to join (`auto`: the one `ray start` runs on this "
                                "node); unset: start a local one")
    num_cpus: int | None = Field(None, ge=1, description="CPUs a local cluster announces (logical: roles take "
                                 "fractions); default max(8, this machine's)")
    engines: EnginesSection = Field(default_factory=EnginesSection, description="the inference engines, one Ray "
                                    "actor each")
    rollout_workers: WorkersSection = Field(default_factory=WorkersSection, description="rollout workers: each "
                                            "runs a rollout manager, its env pools and an engine router")
    trainer: TrainerRanksSection = Field(default_factory=TrainerRanksSection, description="the trainer's ranks, "
                                         "as Ray actors in one PACKed placement group")
    weight_sync: Literal["object_store", "disk", "distributed"] = Field(
        "object_store",
        description="how trained weights reach the engines: Ray's object store (engine actors load them in-process); "
        "disk (the trainer rank writes RUN_DIR/weights/vN, engines load it; needs a file system they share); or "
        "distributed (the trainer rank broadcasts over a gloo / NCCL group that HTTP engines join through SGLang's "
        "/init_weights_update_group: `engines.kind` serve or sglang). Servers registered by URL need disk or "
        "distributed",
    )
    weight_sync_timeout_s: float = Field(120.0, gt=0, description="how long forming the distributed group, or one "
                                         "broadcast, may take")
    health: HealthSection = Field(default_factory=HealthSection, description="how the controller finds failures "
                                  "and how much recovery it spends on them")
    control: ControlSection = Field(default_factory=ControlSection, description="the elastic-rollout control API "
                                    "(HTTP, bearer token)")

    @model_validator(mode="after")
    def _reachable(self) -> ClusterSection:
        for name, role in (("engines", self.engines), ("rollout_workers", self.rollout_workers),
                           ("trainer", self.trainer)):
            if taken := [k for k in role.resources if k in _NOT_CUSTOM or k.startswith("node:")]:
                raise ValueError(f"cluster.{name}.resources: {', '.join(taken)} is not a custom resource (set "
                                 f"cluster.{name}.num_cpus / num_gpus instead)")
        if self.engines.count > self.control.max_engines:
            raise ValueError(f"cluster.engines.count ({self.engines.count}) is over cluster.control.max_engines "
                             f"({self.control.max_engines}): raise max_engines")
        if self.weight_sync == "distributed" and self.engines.kind == "embedded":
            raise ValueError("cluster.weight_sync=distributed reaches engines through SGLang's HTTP routes: set "
                             "cluster.engines.kind=serve or sglang (or use object_store / disk)")
        if self.engines.kind == "vllm" and self.weight_sync != "disk":
            raise ValueError(f"cluster.engines.kind=vllm takes weights from disk only (vLLM 0.32's tensor transports "
                             f"need a GPU): set cluster.weight_sync=disk, not {self.weight_sync}")
        if self.engines.kind == "sglang" and self.weight_sync == "object_store":
            raise ValueError("cluster.engines.kind=sglang takes weights from disk or by broadcast (SGLang's "
                             "/update_weights_from_tensor takes only tensors shared from its own host): set "
                             "cluster.weight_sync=disk or distributed")
        return self
