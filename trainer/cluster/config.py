"""`cluster:`, the training config's section for the distributed run (absent: the run is one process).

Plain pydantic, no Ray import: the config is validated before anything is started, and an in-process run
reads it only to see that it is absent.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EnginesSection(_Strict):
    """The inference engines, one Ray actor each (the embedded transformers engine inside).

    `kind: embedded` serves rollout workers through actor calls; `kind: serve` has each actor serve SGLang's
    native HTTP routes (`relax-gym serve`'s app), which workers call as they would an SGLang server; `kind: sglang`
    has each actor start an SGLang server (`python -m sglang.launch_server`, or `launch`) on its GPUs."""

    kind: Literal["embedded", "serve", "sglang"] = "embedded"
    #: `kind: sglang`: the command that replaces `python -m sglang.launch_server` (a wrapper, a container); it is
    #: given SGLang's arguments (--model-path, --host, --port, --tp-size, --api-key, then `args`)
    launch: list[str] | None = None
    #: `kind: sglang`: more arguments for the server, e.g. [--mem-fraction-static, "0.8"]
    args: list[str] = Field(default_factory=list)
    #: where a served engine listens: default loopback on a local cluster, the node's address on a joined one
    host: str | None = None
    count: int = Field(2, ge=1)
    num_cpus: float = Field(0.5, ge=0)
    #: GPUs of each of the engine's `tp` ranks (the engine reserves num_gpus x tp, on one node)
    num_gpus: float = Field(0, ge=0)
    #: the engine's tensor-parallel size
    tp: int = Field(1, ge=1)


class WorkersSection(_Strict):
    """Rollout workers: each runs a rollout manager, its env pools and an engine router."""

    count: int = Field(1, ge=1)
    num_cpus: float = Field(0.5, ge=0)


class TrainerRanksSection(_Strict):
    """The trainer's ranks, as Ray actors in one PACKed placement group (torchrun's job, done by Ray)."""

    #: ranks: 1 for the torch backend; Megatron's TP x PP x DP
    world_size: int = Field(1, ge=1)
    num_cpus: float = Field(0.5, ge=0)
    #: GPUs of each rank
    num_gpus: float = Field(0, ge=0)


class HealthSection(_Strict):
    """How the controller finds failures and how much recovery it spends on them."""

    #: how often engines and workers are polled for progress
    poll_s: float = Field(2.0, gt=0)
    #: a role with work in flight and no completion for this long is stalled (probed, then replaced)
    stall_s: float = Field(120.0, gt=0)
    #: how long an engine's one-token probe may take
    probe_timeout_s: float = Field(30.0, gt=0)
    #: recreations of one engine (or worker) allowed per `restart_window_s`; past that it stays dead
    engine_restarts: int = Field(3, ge=0)
    worker_restarts: int = Field(3, ge=0)
    restart_window_s: float = Field(600.0, gt=0)
    #: trainer restarts from the last checkpoint for the whole run; one more failure stops the run
    max_trainer_restarts: int = Field(3, ge=0)
    #: a trainer call (a step, a checkpoint, the weights) that has not answered for this long is a lost trainer
    trainer_stall_s: float = Field(1800.0, gt=0)
    #: scale-in never goes below this many engines
    min_engines: int = Field(1, ge=1)
    #: at most this fraction of the engines is replaced in one round; if more than half fail at once, none is
    max_kill_fraction: float = Field(0.25, gt=0, le=1)
    #: how long an episode waits for a live engine before it is aborted ("no live engine")
    engine_wait_s: float = Field(300.0, gt=0)


class ControlSection(_Strict):
    """The elastic-rollout control API (HTTP, bearer token)."""

    enabled: bool = True
    host: str = "127.0.0.1"
    #: 0 picks a free port; the URL is written to RUN_DIR/control.json
    port: int = Field(0, ge=0, le=65535)
    #: the bearer token; else $RELAX_GYM_CONTROL_TOKEN, else one generated into RUN_DIR/control_token (0600)
    token: str | None = None


class ClusterSection(_Strict):
    """Roles as Ray actors: `mode: ray` starts a local Ray cluster, or joins `address` (`auto`: the one
    `ray start` runs on this node)."""

    mode: Literal["ray"] = "ray"
    address: str | None = None
    #: CPUs a local cluster announces (logical: roles take fractions); default max(8, this machine's)
    num_cpus: int | None = Field(None, ge=1)
    engines: EnginesSection = Field(default_factory=EnginesSection)
    rollout_workers: WorkersSection = Field(default_factory=WorkersSection)
    trainer: TrainerRanksSection = Field(default_factory=TrainerRanksSection)
    #: how trained weights reach the engines: Ray's object store (engine actors load them in-process); disk
    #: (the trainer rank writes RUN_DIR/weights/vN, engines load it; needs a file system they share); or
    #: distributed (the trainer rank broadcasts over a gloo / NCCL group that HTTP engines join through SGLang's
    #: /init_weights_update_group: `engines.kind` serve or sglang). Servers registered by URL need disk or
    #: distributed.
    weight_sync: Literal["object_store", "disk", "distributed"] = "object_store"
    #: how long forming the distributed group, or one broadcast, may take
    weight_sync_timeout_s: float = Field(120.0, gt=0)
    health: HealthSection = Field(default_factory=HealthSection)
    control: ControlSection = Field(default_factory=ControlSection)

    @model_validator(mode="after")
    def _reachable(self) -> ClusterSection:
        if self.weight_sync == "distributed" and self.engines.kind == "embedded":
            raise ValueError("cluster.weight_sync=distributed reaches engines through SGLang's HTTP routes: set "
                             "cluster.engines.kind=serve or sglang (or use object_store / disk)")
        if self.engines.kind == "sglang" and self.weight_sync == "object_store":
            raise ValueError("cluster.engines.kind=sglang takes weights from disk or by broadcast (SGLang's "
                             "/update_weights_from_tensor takes only tensors shared from its own host): set "
                             "cluster.weight_sync=disk or distributed")
        return self
