"""The plain-PyTorch training backend: any Hugging Face causal LM or VL / audio model, one process.

It is the embedded default: the model is the same HF class the embedded engine
runs, so weights move between them under their own names with no conversion.
Samples are packed into right-padded micro-batches by a token budget, the
loss function (from `relax_gym.trainer.algorithms`) is applied per micro-batch,
and gradients accumulate without any rescaling because the loss is already
normalised by the whole step's totals (`MicroBatch.step_tokens` /
`step_sequences`).

Precision: fp32 by default on CPU. bf16 (the GPU default) runs the forward
under autocast with fp32 master weights, so AdamW's small updates are not
rounded away; fp16 is refused since it would need loss scaling.
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, cast

import safetensors.torch
import torch
import torch.nn.functional as F
from transformers import set_seed

from relax_gym.cpu.native_heap import release_free_memory
from relax_gym.cpu.onednn_linear import use_onednn_linears
from relax_gym.cpu.process import prepare_process
from relax_gym.engines.continuous import supports_continuous_batching
from relax_gym.models import MEDIA_KEYS, LoadedModel, concat_media, sequence_inputs
from relax_gym.models.loading import save_model
from relax_gym.models.lora import (
    ADAPTER_CONFIG,
    LoraError,
    LoraSpec,
    adapter_tensors,
    add_adapter,
    load_adapter_weights,
    merged_weights,
    save_adapter,
)
from relax_gym.models.moe_routing import batch_routes, replaying, routers
from relax_gym.trainer.backends.base import (
    LogprobOutput,
    attach_old_logprobs,
    build_micro_batch,
    check_samples,
    rng_states,
    set_rng_states,
)
from relax_gym.trainer.backends.hf_folder import load_hf_weights
from relax_gym.trainer.backends.logprob_kernel import token_logprobs
from relax_gym.trainer.backends.prefix_forward import (
    Run,
    forward_shared,
    plan_runs,
    row_offsets,
    to_full_width,
)
from relax_gym.trainer.batch import LossFn, MicroBatch, Sample
from relax_gym.trainer.safe_load import safe_load, safe_save

_OPTIMIZER_FILE, _STATE_FILE = "optimizer.pt", "trainer_state.pt"
#: the weights of a checkpoint written before checkpoints were model folders, under in-memory names
_LEGACY_MODEL_FILE = "model.safetensors"


def enable_tf32(device: torch.device) -> None:
    """On a GPU, float32 matmuls and convolutions (what autocast or bf16 leave in float32) run as TF32, as
    every large-scale trainer sets them: ~10 mantissa bits in the products, float32 accumulation. Process-wide."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def trained_columns(loss_masks: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """Ascending positions whose logits predict a trained token in some row (t - 1 for each trained t).

    Never empty: a micro-batch with nothing trained keeps position 0, so its loss still reaches the
    weights and a step normalised by zero tokens still shows a non-finite gradient norm.
    """
    keep = sorted({t - 1 for mask in loss_masks for t, m in enumerate(mask) if m and 0 < t < width})
    return torch.tensor(keep or [0], dtype=torch.long)


def pack_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of samples, in their given order, grouped so each group's padded size B × T_max ≤ `max_tokens`.

    Greedy and order-preserving (so logprobs come back in order and runs are
    reproducible); a sample longer than the budget gets a micro-batch of its own.
    """
    groups: list[list[int]] = []
    width = 0
    for i, length in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(width, length) <= max_tokens:
            groups[-1].append(i)
            width = max(width, length)
        else:
            groups.append([i])
            width = length
    return groups


class TorchBackend:
    """`TrainBackend` over one HF model on one device (CPU or a GPU), AdamW, token-budget micro-batches.

    The backend owns `loaded.model`: it moves it to `device` (in fp32 when
    training in bf16) and trains it in place, so an embedded engine must hold
    its own copy and receive weights through `hf_state_dict()`. Dropout follows
    the model's config (the Qwen models have none): `train_step` runs in train
    mode as HF gradient checkpointing requires, `logprobs` in eval mode.
    `seed` seeds python, numpy and torch for the process (as `transformers.set_seed`).
    `optimizer` is public so a learning-rate schedule can be attached to it.
    `replay_routes` (an MoE model): every forward's routers take its samples' `routed_experts` (R3).
    `share_prefixes`: a training forward runs a prefix its samples share (a group's prompt) once, where the model
    allows it (`prefix_forward`); False keeps the plain forward, to compare.
    `lora`: train a LoRA adapter (`relax_gym.models.lora`) and freeze the rest; `hf_state_dict` is then the
    adapted layers' merged weights only, and a checkpoint is a PEFT adapter folder.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        grad_clip: float | None = 1.0,
        micro_batch_tokens: int = 4096,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        seed: int = 0,
        gradient_checkpointing: bool = False,
        replay_routes: bool = False,
        share_prefixes: bool = True,
        lora: LoraSpec | None = None,
    ) -> None:
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be positive, got {micro_batch_tokens}")
        prepare_process()  # the CLI's heap settings, for a script that builds a backend too
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        if dtype == torch.float16:
            raise ValueError("fp16 training needs loss scaling, which this backend does not do; use bfloat16")
        #: compute dtype of the forward under autocast, None when it runs in the weights' own dtype
        self.autocast_dtype = dtype if dtype == torch.bfloat16 else None
        enable_tf32(self.device)
        set_seed(seed)
        self.loaded = loaded
        # transformers' `to` is typed through @wraps(nn.Module.to), which mypy reads as unbound
        self.model = loaded.model.to(device=self.device, dtype=torch.float32 if self.autocast_dtype else dtype)  # type: ignore[call-arg]
        if self.device.type == "cpu":
            use_onednn_linears(self.model)  # float32 products at oneDNN's rate, not MKL's (`onednn_linear`)
        if gradient_checkpointing:
            self.model.activation_checkpointing_enable({"use_reentrant": False})
        #: the PeftModel around `model` (whose layers it adapted in place) with `lora`, else None
        self.adapter = add_adapter(self.model, lora, loaded.name) if lora is not None else None
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            # torch's default on a CPU is a loop over parameters whose temporaries (the tied embedding's, 2 x 113 MB
            # on SmolLM2) topped each step's peak; the fused kernel updates in place, as fast
            fused=True if self.device.type == "cpu" else None,
        )
        self.grad_clip = grad_clip
        self.micro_batch_tokens = micro_batch_tokens
        self.version = 0
        #: whether the forward can project only chosen positions onto the vocabulary (`token_logprobs`' columns)
        self._keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        #: with `replay_routes`, the MoE routers that take each sample's `routed_experts` in every forward
        self._routers = routers(self.model) if replay_routes else []
        if replay_routes and not self._routers:
            raise ValueError(f"routing replay: model {loaded.name!r} has no mixture-of-experts routers")
        #: whether a training forward runs a prefix its samples share once (`prefix_forward`): text-only models
        #: with full-attention caches, and not under activation checkpointing, which turns the cache off
        self._shares_prefixes = (share_prefixes and not gradient_checkpointing and not self._routers
                                 and supports_continuous_batching(self.model, loaded.processor is not None))

    # --- forward ------------------------------------------------------------------------------

    def _model_inputs(self, samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
        """Right-padded inputs for a micro-batch, built from each sample's `sequence_inputs`.

        `sequence_inputs` is the one place that knows which keys a model needs
        (e.g. Qwen3-VL's `mm_token_type_ids`). Per-token keys are padded and
        stacked (a key a sample lacks, such as image token types in a text-only
        sample, is all zeros); media features are concatenated in sample order,
        which is the order the models scatter them into placeholder tokens.
        """
        per_sample = [sequence_inputs(self.loaded, s.token_ids, [s.mm_inputs]) for s in samples]
        width = max(len(s.token_ids) for s in samples)
        pad_id = self.loaded.tokenizer.pad_token_id or 0
        inputs: dict[str, torch.Tensor] = {}
        for key in dict.fromkeys(k for x in per_sample for k in x):
            if key in MEDIA_KEYS:
                value = concat_media(key, [x[key] for x in per_sample if key in x])
            else:
                like = next(x[key] for x in per_sample if key in x)
                rows = [
                    x[key][0] if key in x else like.new_zeros(len(s.token_ids))
                    for x, s in zip(per_sample, samples, strict=True)
                ]
                fill = pad_id if key == "input_ids" else 0
                value = torch.stack([F.pad(r, (0, width - len(r)), value=fill) for r in rows])
            if value.is_floating_point():
                value = value.to(self.model.dtype)
            inputs[key] = value.to(self.device)
        return inputs

    def _forward(
        self, samples: Sequence[Sample], temperature: float, with_entropy: bool, *, trained_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T] logprobs (and entropy) of a micro-batch, 0 at position 0 and at padding.

        `trained_only`: exact at the trained tokens (loss_mask 1) and possibly 0 elsewhere, when the model's forward
        takes `logits_to_keep` (most HF causal LMs and Qwen-VL do); every position otherwise. A prefix that
        consecutive samples share then runs once (`prefix_forward`), where the model allows it.
        """
        if trained_only and self._shares_prefixes:
            runs = plan_runs([s.token_ids for s in samples], [s.loss_mask for s in samples])
            if runs is not None:
                return self._forward_shared(samples, runs, temperature, with_entropy)
        inputs = self._model_inputs(samples)
        columns = None
        if trained_only and self._keeps_logits:
            columns = trained_columns([s.loss_mask for s in samples], inputs["input_ids"].shape[1]).to(self.device)
        keep = {} if columns is None else {"logits_to_keep": columns}
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            logits = self.model(**inputs, use_cache=False, **keep).logits
        logprobs, entropy = token_logprobs(logits, inputs["input_ids"], temperature, with_entropy=with_entropy,
                                           columns=columns)
        padding = inputs["attention_mask"] == 0
        return logprobs.masked_fill(padding, 0.0), None if entropy is None else entropy.masked_fill(padding, 0.0)

    def _forward_shared(
        self, samples: Sequence[Sample], runs: list[Run], temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_forward(trained_only=True)` with each run's shared prefix run once (`prefix_forward`)."""
        offsets = row_offsets(runs)
        suffix_masks = [s.loss_mask[o:] for s, o in zip(samples, offsets, strict=True)]
        columns = trained_columns(suffix_masks, max(map(len, suffix_masks))).to(self.device)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            logits, suffix_ids = forward_shared(self.model, runs, [s.token_ids for s in samples], columns)
        logprobs, entropy = token_logprobs(logits, suffix_ids, temperature, with_entropy=with_entropy,
                                           columns=columns)
        lengths = [len(s.token_ids) for s in samples]
        return (to_full_width(logprobs, offsets, lengths),
                None if entropy is None else to_full_width(entropy, offsets, lengths))

    def _replaying(self, samples: Sequence[Sample]) -> AbstractContextManager[None]:
        """The block in which the routers take `samples`' routed experts (R3), as the engine routed them; tokens
        without a recorded route, and every sample without routes, route as the router chooses."""
        if not self._routers or all(s.routed_experts is None for s in samples):
            return nullcontext()
        top_k = int(cast(int, self._routers[0].top_k))
        routes = batch_routes([s.routed_experts for s in samples], max(len(s.token_ids) for s in samples),
                              len(self._routers), top_k)
        return replaying(self.model, routes.to(self.device))

    def _micro_batch(
        self, batch: Sequence[Sample], temperature: float, step_tokens: int, step_sequences: int
    ) -> MicroBatch:
        """The forward with grad of one micro-batch, with the per-token data the loss function reads."""
        logprobs, entropy = self._forward(batch, temperature, with_entropy=True, trained_only=True)
        return build_micro_batch(batch, logprobs, entropy, step_tokens=step_tokens, step_sequences=step_sequences)

    # --- TrainBackend -------------------------------------------------------------------------

    def logprobs(
        self, samples: list[Sample], *, temperature: float = 1.0, with_entropy: bool = False
    ) -> list[LogprobOutput]:
        """Per-token logprobs (no grad) of `log_softmax(logits / temperature)`, as the engine reports them."""
        return self._logprobs(samples, temperature, with_entropy, trained_only=False)

    def _trained_logprobs(self, samples: list[Sample], *, temperature: float = 1.0) -> list[LogprobOutput]:
        """`logprobs` by the training forward, for the old logprobs of a step: exact at the trained tokens, where the
        losses read them, and possibly 0 elsewhere, so only trained positions meet the vocabulary and a shared
        prefix runs once."""
        return self._logprobs(samples, temperature, with_entropy=False, trained_only=True)

    @torch.no_grad()
    def _logprobs(
        self, samples: list[Sample], temperature: float, with_entropy: bool, *, trained_only: bool
    ) -> list[LogprobOutput]:
        check_samples(samples, temperature)
        self.model.eval()
        out: list[LogprobOutput] = []
        for group in pack_micro_batches([len(s.token_ids) for s in samples], self.micro_batch_tokens):
            batch = [samples[i] for i in group]
            with self._replaying(batch):
                logprobs, entropy = self._forward(batch, temperature, with_entropy, trained_only=trained_only)
            for row, i in enumerate(group):
                n = len(samples[i].token_ids)
                out.append(LogprobOutput(logprobs[row, :n].cpu(), None if entropy is None else entropy[row, :n].cpu()))
        return out

    def train_step(self, samples: list[Sample], loss_fn: LossFn, *, temperature: float = 1.0,
                   recompute_old_logprobs: bool = False) -> dict[str, float]:
        """Forward/backward over micro-batches (token budget), clip, one AdamW step; version += 1.

        A step whose gradient norm is not finite (e.g. a loss normalised by zero
        trained tokens) is not applied, so one bad batch cannot destroy the
        weights; it still counts as a step (`skipped` = 1) so versions stay in
        lockstep with the loop's step count.
        """
        old = attach_old_logprobs(self, samples, temperature, self._trained_logprobs) if recompute_old_logprobs else {}
        check_samples(samples, temperature)
        step_tokens = sum(sum(s.loss_mask) for s in samples)
        step_sequences = sum(1 for s in samples if any(s.loss_mask))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)  # nothing left over from a step that raised midway
        groups = pack_micro_batches([len(s.token_ids) for s in samples], self.micro_batch_tokens)
        summed: dict[str, float] = defaultdict(float)
        loss_sum = 0.0
        for group in groups:
            batch = [samples[i] for i in group]
            with self._replaying(batch):  # the backward too: activation checkpointing runs the forward again
                micro_batch = self._micro_batch(batch, temperature, step_tokens, step_sequences)
                loss, metrics = loss_fn(micro_batch)
                if loss.requires_grad:  # a loss_fn may return a constant for a micro-batch with nothing trained
                    loss.backward()
            loss_sum += loss.item()
            for key, value in metrics.items():
                summed[key] += float(value)

        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip or math.inf).item()
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        release_free_memory()  # the step's activations and gradients, in pieces the next step may not fit
        return {
            **summed,
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "micro_batches": float(len(groups)),
            "tokens": float(step_tokens),
            "sequences": float(step_sequences),
            "skipped": float(skipped),
            **old,
        }

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies of the weights under the HF names of the model class the engine also runs.

        Tensors shared in the model (tied embeddings) stay shared in the copy, so
        they are copied once and keep their tie after `load_state_dict`. With an
        adapter: the adapted layers' merged weights only (the rest is the base's).
        """
        if self.adapter is not None:
            return merged_weights(self.model)
        copies: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.model.state_dict().items():
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
            if key not in copies:
                copies[key] = tensor.detach().to("cpu", copy=True)
            out[name] = copies[key]
        return out

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies of the adapter's A and B under peft's saved names (what `adapter_model.safetensors` holds)."""
        if self.adapter is None:
            raise LoraError("adapter_state_dict: this backend trains full weights (no trainer.lora)")
        return adapter_tensors(self.adapter)

    def save_model_folder(self, path: Path) -> None:
        """The model part of a checkpoint, which `load_model` reads: an HF model folder, or with an adapter a PEFT
        adapter folder (with the tokenizer and its chat template)."""
        if self.adapter is not None:
            save_adapter(self.adapter, self.loaded.processor or self.loaded.tokenizer, path)
        else:
            save_model(self.loaded, path)

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        """`path/` becomes a Hugging Face model folder plus the training state: optimizer.pt, trainer_state.pt.

        The model folder is what `save_pretrained` writes (config, generation
        config, weights under their saved names) and the tokenizer or processor
        with its chat template, so `from_pretrained(path)` loads the checkpoint.
        The weights are stored once: `load_checkpoint` maps saved names back to
        in-memory ones (see `relax_gym.trainer.backends.hf_folder`).

        With an adapter, `path/` is a PEFT adapter folder instead (`adapter_config.json`,
        `adapter_model.safetensors`, the tokenizer): peft, vLLM and SGLang load it on the base.

        The two .pt files hold only tensors and plain data, so that loading them
        cannot run code (`relax_gym.trainer.safe_load`); `extra` must be plain
        data too (None, bools, numbers, strings, lists / tuples / dicts of them,
        tensors), else this raises ValueError.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.save_model_folder(path)
        safe_save(self.optimizer.state_dict(), path / _OPTIMIZER_FILE)
        safe_save({"version": self.version, "extra": extra, "rng": rng_states()}, path / _STATE_FILE)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restores weights, optimizer, RNG states and version in place; returns `extra`.

        A .pt file that holds anything but tensors and plain data (a planted
        pickle, or a checkpoint of a relax_gym that pickled numpy's RNG state)
        raises `UnsafeCheckpointError` before anything is restored, and is never unpickled.
        A checkpoint from before checkpoints were model folders (no config.json:
        model.safetensors under in-memory names) still resumes.
        """
        path = Path(path)
        optimizer_state = safe_load(path / _OPTIMIZER_FILE, map_location=self.device)
        state = safe_load(path / _STATE_FILE)
        adapter = (path / ADAPTER_CONFIG).is_file()
        if adapter != (self.adapter is not None):
            raise LoraError(f"checkpoint {path} holds {'a LoRA adapter' if adapter else 'full weights'}, but this "
                            f"run {'trains full weights' if adapter else 'has trainer.lora'}: resume it with the "
                            "trainer.lora it was trained with, or start a new run_dir")
        if self.adapter is not None:
            load_adapter_weights(self.adapter, path)
        elif (path / "config.json").is_file():
            load_hf_weights(self.model, path)
        else:
            safetensors.torch.load_model(self.model, str(path / _LEGACY_MODEL_FILE), device=str(self.device))
        self.optimizer.load_state_dict(optimizer_state)
        set_rng_states(state["rng"])
        self.version = state["version"]
        return state["extra"]
