"""`MegatronBackend`: the TrainBackend contract on a megatron-core `GPTModel` with TP / PP / DP.

Layout. Every rank of the job constructs the backend and calls each method with
the same arguments (SPMD, as under `torchrun`): the full list of samples goes
to every rank, each data-parallel rank takes a token-balanced share, and the
results (logprobs, metrics, HF weights) come back complete on every rank. The
data-parallel size is what the world size leaves after TP × PP. Without a
process group (a plain single process) the backend starts a one-rank group
itself (NCCL on a GPU, gloo on the CPU).

Training. The step runs through megatron's own forward/backward schedule
(micro-batches, pipeline p2p, DDP gradient reduction), its distributed Adam
with gradient clipping, and a constant-LR `OptimizerParamScheduler` (which is
also what leaves norms and biases without weight decay, as Megatron does).
The loss function normalises by the step totals in the `MicroBatch`, so the
gradients must be summed, never averaged, over micro-batches and DP ranks: the
backend reports its losses to the schedule with a token count of 0 under
`calculate_per_token_loss`, which makes megatron leave them unscaled.

Logprobs are computed on the vocabulary-parallel logits without gathering
them, a chunk of rows at a time (`vocab_logprobs`): max, sum-exp and the target
logit are reduced over the TP group, and the backward pass recomputes each
chunk's softmax, so entropy bonuses train through TP too.

Checkpoints are `torch.save` files (weights per model-parallel rank,
optimizer shards and RNG per rank), loadable into the same (TP, PP, DP) layout.
They hold only tensors and plain data and are read with
`relax_gym.trainer.safe_load`, so resuming cannot run code planted in them.
Rank 0 also writes the full weights under HF names, with the config and the
tokenizer, so every checkpoint folder loads with `from_pretrained` too.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from mbridge.core.util import unwrap_model
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from relax_gym.models import TINY_MODELS, LoadedModel, load_model
from relax_gym.models.loading import save_pretrained_folder
from relax_gym.trainer.backends.base import (
    LogprobOutput,
    attach_old_logprobs,
    build_micro_batch,
    check_samples,
    pad_rows,
    rng_states,
    set_rng_states,
)
from relax_gym.trainer.backends.megatron import compat, moe_replay
from relax_gym.trainer.backends.megatron.bridge import WeightSource, export_hf, make_bridge
from relax_gym.trainer.backends.megatron.vocab_logprobs import vocab_parallel_token_logprobs
from relax_gym.trainer.backends.torch_backend import enable_tf32
from relax_gym.trainer.batch import LossFn, MicroBatch, Sample
from relax_gym.trainer.safe_load import check_saved, safe_load

ModelSource = str | Path | LoadedModel | PreTrainedModel

#: bump when the checkpoint layout changes (2: RNG states as plain data, loaded without unpickling code)
CHECKPOINT_FORMAT = 2


@dataclass
class _Batch:
    """One right-padded micro-batch as the model consumes it; `indices` point into the step's samples."""

    indices: list[int]
    lengths: list[int]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    #: with routing replay: [layers, tokens, top_k] in megatron's (sequence-first) token order, -1 unrecorded
    routes: torch.Tensor | None = None

    @property
    def empty(self) -> bool:
        """A placeholder for a DP rank left without samples, so that its collectives still match."""
        return not self.indices


def _check(samples: Sequence[Sample], temperature: float) -> None:
    """The shared sample checks, plus this backend's limit: text models only."""
    check_samples(samples, temperature)
    for i, s in enumerate(samples):
        if s.mm_inputs:
            raise NotImplementedError(f"sample {i} has multimodal inputs; the Megatron backend trains text models")


def _init_distributed(tp: int, pp: int, dp: int | None, ep: int = 1) -> None:
    """A process group (torchrun's, or one rank's own) and megatron's parallel state."""
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        else:  # one rank; on a GPU NCCL, whose collectives megatron's grad buffers use (gloo lacks or emulates them)
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp) or (dp is not None and dp * tp * pp != world):
        raise ValueError(f"world size {world} is not tp ({tp}) × pp ({pp}) × dp ({dp or 'any'})")
    if (world // (tp * pp)) % ep:
        raise ValueError(f"ep={ep} must divide the data-parallel size {world // (tp * pp)} (experts are spread over "
                         "data-parallel ranks)")
    if mpu.model_parallel_is_initialized():
        layout = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size(),
                  mpu.get_expert_model_parallel_world_size())
        if layout != (tp, pp, ep):
            raise RuntimeError(f"megatron's parallel state is already (tp, pp, ep) = {layout}; one layout per "
                               "process")
    else:
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                      expert_model_parallel_size=ep)


class _HFFiles(NamedTuple):
    """What a checkpoint's HF model folder needs besides the weights and the config; None where unknown."""

    tokenizer: Any | None  # the tokenizer (or processor), which saves the chat template too
    generation_config: GenerationConfig | None


def _hf_source(model: ModelSource) -> tuple[PretrainedConfig, WeightSource, _HFFiles]:
    """The HF config, where its weights come from (a folder read lazily, or an in-memory model), and the files
    that make a checkpoint a model folder."""
    if isinstance(model, str) and model in TINY_MODELS:
        model = load_model(model)
    if isinstance(model, LoadedModel):
        files = _HFFiles(model.processor or model.tokenizer, model.model.generation_config)
        return model.model.config, model.model.state_dict(), files
    if isinstance(model, PreTrainedModel):
        return model.config, model.state_dict(), _HFFiles(None, model.generation_config)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a Hugging Face checkpoint folder (no config.json)")
    return AutoConfig.from_pretrained(path, local_files_only=True), path, _folder_files(path)


def _folder_files(path: Path) -> _HFFiles:
    """The tokenizer and generation config of a checkpoint folder, each None when the folder has none."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None
    try:
        generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        generation_config = None
    return _HFFiles(tokenizer, generation_config)


class MegatronBackend:
    """TrainBackend on megatron-core; see the module docstring for the layout and the maths."""

    @compat.on_cpu
    def __init__(
        self,
        model: ModelSource,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        ep: int = 1,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
        micro_batch_tokens: int = 4096,
        seed: int = 0,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        dtype: Literal["auto", "float32", "bfloat16"] = "auto",
        replay_routes: bool = False,
    ):
        """`model`: a tiny-model name, an HF checkpoint folder, a `LoadedModel` or a `PreTrainedModel`.

        `dp` defaults to what the world size leaves after `tp × pp`; pass it to
        assert the layout. `grad_clip` None or ≤ 0 turns clipping off (the norm is still reported).
        `dtype` of the parameters and the forward: "auto" is bfloat16 on a GPU, float32 on a CPU; in bfloat16
        the optimizer keeps float32 main parameters and gradients (megatron's mixed precision), and the
        checkpoint saves those main parameters, so a resumed run continues from the same numbers.
        `ep`: a mixture-of-experts model's experts spread over that many data-parallel ranks.
        `replay_routes` (an MoE model): every forward's routers take its samples' `routed_experts` (R3), through
        megatron-core's own router replay (`moe_replay`).
        """
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be positive, got {micro_batch_tokens}")
        _init_distributed(tp, pp, dp, ep)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        self.version = 0
        self.micro_batch_tokens = micro_batch_tokens
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.tp, self.pp, self.dp = tp, pp, mpu.get_data_parallel_world_size()
        hf_config, weights, self._hf_files = _hf_source(model)
        if hf_config.vocab_size % tp:
            # padding the vocabulary would add logits that the log-softmax would have to mask out
            raise ValueError(f"vocab_size {hf_config.vocab_size} is not divisible by tp={tp}")
        bf16 = dtype == "bfloat16" or (dtype == "auto" and self.device.type == "cuda")
        self.params_dtype = torch.bfloat16 if bf16 else torch.float32
        enable_tf32(self.device)
        self.bridge = make_bridge(hf_config, dtype=self.params_dtype)
        self.bridge.set_extra_args(calculate_per_token_loss=True, variable_seq_lengths=True)
        if replay_routes:
            if not getattr(hf_config, "num_experts_per_tok", None):
                raise ValueError(f"routing replay: a {hf_config.model_type} model has no mixture-of-experts routers")
            self.bridge.set_extra_args(moe_enable_routing_replay=True)
        self.replay_routes = replay_routes
        with torch.random.fork_rng(devices=[]):  # init values are overwritten; keep the caller's RNG
            torch.manual_seed(seed)
            self.models: list[DistributedDataParallel] = self.bridge.get_model(
                wrap_with_ddp=True, fp16=False, bf16=bf16, data_parallel_random_init=False,
                ddp_config={"grad_reduce_in_fp32": True, "use_distributed_optimizer": True,
                            "overlap_grad_reduce": False, "overlap_param_gather": False},
            )
        self.bridge.load_weights(self.models, weights)
        del weights
        get_model_config(self.models[0]).finalize_model_grads_func = finalize_model_grads
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=adam_betas[0],
                adam_beta2=adam_betas[1], adam_eps=adam_eps,
                clip_grad=grad_clip if grad_clip and grad_clip > 0 else math.inf,
                loss_scale=1.0,  # a constant scaler of 1 changes no number; it adds the found-inf check
                use_distributed_optimizer=True, params_dtype=self.params_dtype, bf16=bf16,
            ),
            self.models,
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=lr, max_lr=lr, min_lr=lr, lr_warmup_steps=0, lr_decay_steps=1,
            lr_decay_style="constant", start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=1,
            wd_incr_style="constant",
        )

    # --- contract -----------------------------------------------------------------------
    @compat.on_cpu
    def logprobs(self, samples: list[Sample], *, temperature: float = 1.0,
                 with_entropy: bool = False) -> list[LogprobOutput]:
        """Per-token logprobs (no grad) of `log_softmax(logits / temperature)`, as the engine reports them."""
        _check(samples, temperature)
        for m in self.models:
            m.eval()
        collect = partial(self._collect, temperature=temperature, with_entropy=with_entropy)
        with torch.no_grad():
            rows = self._run(samples, collect, forward_only=True)
        out: list[LogprobOutput | None] = [None] * len(samples)
        for batch_rows in rows:
            for i, logprobs, entropy in batch_rows:
                out[i] = LogprobOutput(logprobs=logprobs, entropy=entropy)
        return out  # type: ignore[return-value]  # every index is filled by exactly one DP rank

    @compat.on_cpu
    def train_step(self, samples: list[Sample], loss_fn: LossFn, *, temperature: float = 1.0,
                   recompute_old_logprobs: bool = False) -> dict[str, float]:
        """Forward/backward over micro-batches (token budget), clip, one Adam step; version += 1.

        Metrics: the loss function's, summed over micro-batches and DP ranks, and
        `loss`, `grad_norm`, `lr`, `micro_batches`, `tokens`, `sequences`,
        `skipped` (the torch backend's keys). A step with a non-finite gradient
        is not applied (megatron's found-inf check, through a constant loss
        scale of 1) but still counts as a step.
        """
        old = attach_old_logprobs(self, samples, temperature) if recompute_old_logprobs else {}
        _check(samples, temperature)
        for m in self.models:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        totals = (sum(sum(s.loss_mask) for s in samples), sum(1 for s in samples if any(s.loss_mask)))
        loss = partial(self._loss, samples=samples, loss_fn=loss_fn, temperature=temperature, totals=totals)
        summed: dict[str, float] = defaultdict(float)
        outputs = self._run(samples, loss, forward_only=False)
        for metrics in outputs:
            for key, value in metrics.items():
                summed[key] += value
        applied, grad_norm, _ = self.optimizer.step()
        if applied:
            self.scheduler.step(increment=1)
        self.version += 1
        return {
            **summed,
            "grad_norm": math.nan if grad_norm is None else float(grad_norm),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "micro_batches": float(len(outputs)),
            "tokens": float(totals[0]),
            "sequences": float(totals[1]),
            "skipped": float(not applied),
            **old,
        }

    @compat.on_cpu
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Current weights under Hugging Face names, full (gathered) CPU copies, on global rank 0 (the one that
        sends them to engines); {} on the other ranks, which take part in the gather."""
        return export_hf(self.bridge, self.models, keep=dist.get_rank() == 0)

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError("the megatron backend trains full weights only (trainer.lora needs "
                                  "trainer.backend=torch)")

    @compat.on_cpu
    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        """Model, optimizer (+ LR scheduler), RNG states and `extra`; collective, all ranks write into `path`.

        Rank 0 writes the Hugging Face model folder (the weights gathered under
        HF names as `save_pretrained` stores them, config, generation config,
        tokenizer and chat template), which every rank helps gather; resuming
        reads the per-rank files below, which hold the same weights in this
        layout's shards.
        `model_tp{t}_pp{p}[_ep{e}].pt`: the (TP, PP, EP) shard of the weights and the scheduler,
        from the first data-parallel rank holding it; `rank{r}.pt`: each rank's optimizer shard (the torch Adam
        states of its distributed-optimizer slice) and RNG states; `meta.pt`:
        version, layout and `extra`. megatron's own DP-rank-0 parameter-state
        format is not used: with torch's AdamW (no apex / TE) it fails on the
        per-parameter `step` entry.

        Every file holds only tensors and plain data (`load_checkpoint` refuses
        anything else); `extra` must be plain data too, else this raises
        ValueError (on rank 0, after every rank has written its files).
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        hf_weights = export_hf(self.bridge, self.models, keep=dist.get_rank() == 0)  # collective: every rank gathers
        hf_error = None
        if dist.get_rank() == 0:
            try:
                self._save_hf(path, hf_weights)
            except Exception as err:  # raised after the barrier, so no rank is left waiting for this one
                hf_error = err
        del hf_weights
        written = []
        # one writer per shard: data-parallel rank 0, or with experts spread, each expert-parallel rank's first
        if mpu.get_expert_data_parallel_rank() == 0:
            written.append(path / f"model_{self._mp_tag()}.pt")
            torch.save({"model": [unwrap_model(m).state_dict() for m in self.models],
                        "scheduler": self.scheduler.state_dict()}, written[-1])
        written.append(path / f"rank{dist.get_rank():05d}.pt")
        torch.save({"optimizers": [o.state_dict() for o in self._torch_optimizers()], "rng": _rng_state(),
                    "main_params": [p.detach().clone() for p in self._main_params()]}, written[-1])
        if dist.get_rank() == 0:
            written.append(path / "meta.pt")
            torch.save({"format": CHECKPOINT_FORMAT, "version": self.version, "layout": self._layout(),
                        "extra": extra}, written[-1])
        unsafe = None
        try:  # before the barrier: once every rank passes it, rank 0 may move the folder (CheckpointManager renames
            for file in written:  # `.step_N.partial`), and a rank still reading its own files found them gone
                check_saved(file)
        except ValueError as err:
            unsafe = err
        dist.barrier()
        if hf_error is not None:  # raised after the barrier: a rank that raises leaves none waiting
            raise hf_error
        if unsafe is not None:
            raise unsafe

    def _save_hf(self, path: Path, weights: dict[str, torch.Tensor]) -> None:
        """`save_pretrained` of an HF model of the trained config holding `weights` (built without memory)."""
        dtype = next(iter(weights.values())).dtype  # save_pretrained records the shell's dtype in config.json
        with torch.device("meta"):  # save_pretrained needs the model only for its config and names
            shell = AutoModelForCausalLM.from_config(self.bridge.hf_config, dtype=dtype)
        if self._hf_files.generation_config is not None:
            shell.generation_config = self._hf_files.generation_config
        save_pretrained_folder(path, shell, self._hf_files.tokenizer, state_dict=weights)

    @compat.on_cpu
    @torch.no_grad()  # fp32 main params are views of the (grad-requiring) model params; loading writes them
    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restores what `save_checkpoint` wrote (same TP/PP/DP layout) and returns `extra`.

        Each file is read with `safe_load`: one holding anything but tensors and
        plain data raises `UnsafeCheckpointError` and is never unpickled.
        """
        path = Path(path)
        meta = safe_load(path / "meta.pt")
        if meta["format"] != CHECKPOINT_FORMAT or meta["layout"] != self._layout():
            raise ValueError(f"{path}: checkpoint format {meta['format']} / layout {meta['layout']}, "
                             f"this backend reads format {CHECKPOINT_FORMAT} / layout {self._layout()}")
        shared_file, mine_file = path / f"model_{self._mp_tag()}.pt", path / f"rank{dist.get_rank():05d}.pt"
        shared = safe_load(shared_file, map_location=self.device)
        mine = safe_load(mine_file, map_location=self.device)
        for model_state in shared["model"]:
            _check_extra_state(model_state, shared_file)
        main, saved = self._main_params(), mine.get("main_params", [])  # none before bf16 was saved
        if len(saved) != len(main):
            raise ValueError(f"{mine_file}: {len(saved)} float32 main parameters, this backend "
                             f"({str(self.params_dtype).removeprefix('torch.')}) has {len(main)}: resume with the "
                             "dtype the run was saved with")
        for m, model_state in zip(self.models, shared["model"], strict=True):
            unwrap_model(m).load_state_dict(model_state)
        self.optimizer.reload_model_params()  # main params from the model's: exact in float32, rounded in bf16
        for param, value in zip(main, saved, strict=True):
            param.copy_(value)  # so a bf16 run's float32 main params are restored, not rebuilt from bf16
        for optimizer, state in zip(self._torch_optimizers(), mine["optimizers"], strict=True):
            optimizer.load_state_dict(state)
        self.scheduler.load_state_dict(shared["scheduler"])
        _set_rng_state(mine["rng"])
        self.version = meta["version"]
        return meta["extra"]

    # --- micro-batches and the schedule ---------------------------------------------------
    def _run(self, samples: Sequence[Sample], reduce: Callable[..., Any], *, forward_only: bool) -> list[Any]:
        """Megatron's schedule over this DP rank's micro-batches; `reduce`'s outputs of all micro-batches of all
        DP ranks."""
        batches = self._micro_batches(samples)
        try:
            store = get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, reduce=reduce),
                data_iterator=iter(batches),
                model=self.models,
                num_microbatches=len(batches),
                seq_length=max(b.input_ids.size(1) for b in batches),
                micro_batch_size=max(b.input_ids.size(0) for b in batches),
                forward_only=forward_only,
                collect_non_loss_data=forward_only,
            )
        finally:
            if self.replay_routes:
                for model in self.models:
                    moe_replay.forget(model)
        # outputs exist on the last pipeline stage; every TP rank there holds the same ones
        holds = mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0
        gathered: list[list[Any] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, store if holds else None)
        return [output for part in gathered if part is not None for output in part]

    def _forward_step(self, data_iterator: Iterator[_Batch], model: torch.nn.Module,
                      reduce: Callable[..., Any]) -> tuple[torch.Tensor, Callable[..., Any]]:
        batch = next(data_iterator)
        if self.replay_routes:
            moe_replay.replay(model, batch.routes)
        return model(batch.input_ids, batch.position_ids, None), partial(reduce, batch)

    def _micro_batches(self, samples: Sequence[Sample]) -> list[_Batch]:
        """This DP rank's samples in micro-batches of at most `micro_batch_tokens` padded tokens."""
        lengths = [len(s.token_ids) for s in samples]
        groups: list[list[int]] = []
        longest = 0
        for i in self._dp_share(lengths):
            wider = max(longest, lengths[i])
            if groups and (len(groups[-1]) + 1) * wider <= self.micro_batch_tokens:
                groups[-1].append(i)
                longest = wider
            else:
                groups.append([i])
                longest = lengths[i]
        if not groups:
            placeholder = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            return [_Batch([], [], placeholder, placeholder)]
        batches = []
        for idx in groups:
            width = max(lengths[i] for i in idx)
            ids = pad_rows([samples[i].token_ids for i in idx], width, dtype=torch.long, device=self.device)
            positions = torch.arange(width, device=self.device).expand(len(idx), width)
            routes = None
            if self.replay_routes and any(samples[i].routed_experts is not None for i in idx):
                config = self.bridge.config
                routes = moe_replay.sequence_first_routes([samples[i].routed_experts for i in idx], width,
                                                          config.num_layers, config.moe_router_topk)
            batches.append(_Batch(idx, [lengths[i] for i in idx], ids, positions, routes))
        return batches

    def _dp_share(self, lengths: Sequence[int]) -> list[int]:
        """Indices this DP rank trains on: longest first to the least-loaded rank, then in step order."""
        loads = [0] * self.dp
        owner = {}
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            rank = min(range(self.dp), key=loads.__getitem__)
            owner[i] = rank
            loads[rank] += lengths[i]
        me = mpu.get_data_parallel_rank()
        return [i for i in range(len(lengths)) if owner[i] == me]

    def _collect(self, batch: _Batch, logits: torch.Tensor, non_loss_data: bool = True, *, temperature: float,
                 with_entropy: bool) -> list[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """forward-only reduction: each sample's unpadded logprobs (+ entropy) as CPU fp32."""
        logprobs, entropy = vocab_parallel_token_logprobs(logits, batch.input_ids, temperature,
                                                           with_entropy=with_entropy)
        return [
            (i, logprobs[row, :n].float().cpu(), None if entropy is None else entropy[row, :n].float().cpu())
            for row, (i, n) in enumerate(zip(batch.indices, batch.lengths, strict=True))
        ]

    def _loss(self, batch: _Batch, logits: torch.Tensor, *, samples: Sequence[Sample], loss_fn: LossFn,
              temperature: float, totals: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Training reduction: `loss_fn` on the contract's MicroBatch, returned unscaled (token count 0)."""
        logprobs, entropy = vocab_parallel_token_logprobs(logits, batch.input_ids, temperature, with_entropy=True)
        unscaled = torch.zeros((), dtype=torch.int, device=self.device)
        if batch.empty:
            return logprobs.sum() * 0.0, unscaled, {"loss": 0.0}
        loss, metrics = loss_fn(self._micro_batch(batch, samples, logprobs, entropy, totals))
        return loss, unscaled, {**{k: float(v) for k, v in metrics.items()}, "loss": float(loss.detach())}

    def _micro_batch(self, batch: _Batch, samples: Sequence[Sample], logprobs: torch.Tensor,
                     entropy: torch.Tensor | None, totals: tuple[int, int]) -> MicroBatch:
        """The contract's MicroBatch: right-padded [B, T] fields, 0 at padding (as the torch backend), step totals."""
        width = logprobs.size(1)
        padding = torch.arange(width, device=logprobs.device) >= torch.tensor(batch.lengths,
                                                                             device=logprobs.device)[:, None]
        return build_micro_batch([samples[i] for i in batch.indices], logprobs.masked_fill(padding, 0.0),
                                 None if entropy is None else entropy.masked_fill(padding, 0.0),
                                 step_tokens=totals[0], step_sequences=totals[1])

    # --- checkpoint helpers -----------------------------------------------------------------
    def _layout(self) -> dict[str, int]:
        ep = mpu.get_expert_model_parallel_world_size()
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, **({"ep": ep} if ep > 1 else {})}

    def _main_params(self) -> list[torch.Tensor]:
        """This rank's float32 main copies of the bf16 parameters (none in float32, where the main params are
        the model's own, saved with it), in megatron's order."""
        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [p for o in optimizers for group in o.shard_fp32_from_float16_groups for p in group]

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch Adams inside megatron's (possibly chained) optimizer, each over this rank's shard."""
        return [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    @staticmethod
    def _mp_tag() -> str:
        """The model shard's name: (TP, PP) rank, and the expert-parallel rank (its own experts) where ep > 1."""
        tag = f"tp{mpu.get_tensor_model_parallel_rank()}_pp{mpu.get_pipeline_model_parallel_rank()}"
        if mpu.get_expert_model_parallel_world_size() > 1:
            tag += f"_ep{mpu.get_expert_model_parallel_rank()}"
        return tag


def _check_extra_state(model_state: dict[str, Any], file: Path) -> None:
    """`_extra_state` entries must be None: the one value megatron's local-spec layers give them.

    Those layers keep no extra state (`get_extra_state` returns None, `set_extra_state`
    ignores its argument), so None is all a checkpoint of this backend holds there.
    Transformer Engine's layers would hold a BytesIO or a tensor of pickled bytes
    that TE unpickles on load: refused here, so that a layer spec with TE could not
    turn a checkpoint back into code without this check being revisited.
    """
    for key, value in model_state.items():
        if key.rsplit(".", 1)[-1] == "_extra_state" and value is not None:
            raise ValueError(f"{file}: {key} holds a {type(value).__name__}; this backend's layers keep no extra "
                             "state (megatron-core's local layer spec), so it holds None there")


def _rng_state() -> dict[str, Any]:
    """Every RNG state as plain data and tensors (`safe_load` reads them back): the shared ones and megatron's."""
    return {**rng_states(), "megatron": tensor_parallel.get_cuda_rng_tracker().get_states()}  # name -> ByteTensor


def _set_rng_state(state: dict[str, Any]) -> None:
    # RNG states are CPU ByteTensors; the file was loaded onto the training device
    set_rng_states(state)
    tensor_parallel.get_cuda_rng_tracker().set_states({k: v.cpu() for k, v in state["megatron"].items()})
