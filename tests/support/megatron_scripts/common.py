"""One set of checks for a `MegatronBackend`, run in-process (TP=1) and under torchrun (TP=2, DP=2).

Everything is compared with a plain PyTorch reference computed here on the HF
model itself: per-token logprobs, one training step with the same loss and
AdamW hyperparameters, and the weights after it. `run_checks` returns numbers
(JSON-serialisable); the test module asserts on them.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel

from relax_gym.trainer.backends.base import TrainBackend
from relax_gym.trainer.batch import MicroBatch, Sample

LR, WEIGHT_DECAY, GRAD_CLIP, TEMPERATURE = 1e-2, 0.1, 1.0, 0.8
#: small enough that a step has several micro-batches
MICRO_BATCH_TOKENS = 40
#: Adam's first update is lr·g/(|g|+eps): where |g| is ~eps, rounding noise in g (a different summation
#: order: fused QKV, TP, micro-batches) moves the update by a visible fraction of lr. Weights whose gradient
#: is at least this large are compared tightly; the rest only against a bound.
ACTIVE_GRAD = 1e-6


#: megatron-core's notices on a machine without TE / apex / CUDA, and its internal deprecations
MEGATRON_WARNINGS = (
    "ignore:.*(Apex|Transformer Engine).*not installed",
    "ignore:Warning. tp_group is None:DeprecationWarning",
    "ignore:MLP requires ffn_hidden_size:DeprecationWarning",
    "ignore:The .grad attribute of a Tensor that is not a leaf",
    "ignore:.*deprecated:FutureWarning",
    "ignore:full scope is deprecated",
    "ignore:The 'megatron.core.transformer.custom_layers:DeprecationWarning",
)


def make_samples(seed: int = 0, vocab: int = 1024) -> list[Sample]:
    """Varied lengths and prompt/completion masks, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (n, prompt) in enumerate([(7, 3), (19, 5), (5, 2), (12, 4), (16, 9), (9, 1)]):
        samples.append(Sample(
            token_ids=torch.randint(0, vocab, (n,), generator=g).tolist(),
            loss_mask=[0] * prompt + [1] * (n - prompt),
            rollout_logprobs=[0.0] * n,
            advantage=[1.0, -0.5, 2.0, -1.0, 0.25, 0.75][i],
        ))
    return samples


def loss_fn(mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean policy gradient with an entropy bonus (so entropy gradients cross TP too)."""
    pg = -(mb.logprobs * mb.advantages * mb.mask).sum() / mb.step_tokens
    bonus = (mb.entropy * mb.mask).sum() / mb.step_tokens
    return pg - 0.01 * bonus, {"masked_tokens": float(mb.mask.sum())}


def hf_token_logprobs(model: PreTrainedModel, ids: list[int], temperature: float,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's alignment on a plain HF forward: [T] logprobs and entropy, position 0 = 0."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return F.pad(picked, (1, 0)), F.pad(entropy, (1, 0))


def reference_step(model: PreTrainedModel, samples: list[Sample]) -> tuple[float, dict[str, torch.Tensor]]:
    """One AdamW step on the HF model with Megatron's param groups (no decay on 1-D params); loss, grads."""
    model.train()
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
         {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}],
        lr=LR,
    )
    step_tokens = sum(sum(s.loss_mask) for s in samples)
    total = 0.0
    for s in samples:
        logprobs, entropy = hf_token_logprobs(model, s.token_ids, TEMPERATURE)
        row = lambda values: torch.tensor([values], dtype=torch.float32)  # noqa: E731
        mb = MicroBatch(logprobs=logprobs[None], entropy=entropy[None], mask=row(s.loss_mask),
                        advantages=row([s.advantage] * len(s.token_ids)), rollout_logprobs=row(s.rollout_logprobs),
                        old_logprobs=None, ref_logprobs=None, teacher_logprobs=None,
                        step_tokens=step_tokens, step_sequences=len(samples))
        loss, _ = loss_fn(mb)
        loss.backward()
        total += loss.item()
    grads = {name: p.grad.clone() for name, p in params.items()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    return total, grads


def _max_diff(outputs: list[Any], refs: list[torch.Tensor], field: str) -> float:
    return max((getattr(o, field) - r).abs().max().item() for o, r in zip(outputs, refs, strict=True))


def run_checks(make_backend: Callable[[], TrainBackend], hf_model: PreTrainedModel, workdir: Path) -> dict[str, Any]:
    """Logprobs, a step against the reference, export → HF, checkpoint → resume; numbers for the test."""
    out: dict[str, Any] = {}
    samples = make_samples(vocab=hf_model.config.vocab_size)
    reference = copy.deepcopy(hf_model)
    t0 = time.perf_counter()
    backend = make_backend()
    out["build_s"] = time.perf_counter() - t0

    with torch.no_grad():
        ref_rows = [hf_token_logprobs(hf_model, s.token_ids, TEMPERATURE) for s in samples]
    t0 = time.perf_counter()
    got = backend.logprobs(samples, temperature=TEMPERATURE, with_entropy=True)
    out["logprobs_s"] = time.perf_counter() - t0
    out["logprob_diff"] = _max_diff(got, [r[0] for r in ref_rows], "logprobs")
    out["entropy_diff"] = _max_diff(got, [r[1] for r in ref_rows], "entropy")
    one = backend.logprobs(samples[:1], temperature=TEMPERATURE)  # fewer samples than DP ranks
    out["one_sample_logprob_diff"] = _max_diff(one, [ref_rows[0][0]], "logprobs")

    t0 = time.perf_counter()
    metrics = backend.train_step(samples, loss_fn, temperature=TEMPERATURE)
    out["step_s"] = time.perf_counter() - t0
    out["metrics"] = metrics
    out["ref_loss"], grads = reference_step(reference, samples)
    exported = backend.hf_state_dict()  # rank 0's; {} on the others, which only help gather it
    if dist.is_initialized() and dist.get_world_size() > 1:
        sizes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(sizes, len(exported))
        out["export_sizes"] = sizes
        box = [exported]
        dist.broadcast_object_list(box, src=0)  # every rank checks the same weights below
        exported = box[0]
    ref_state = reference.state_dict()
    out["exported_keys_match"] = set(exported) == set(ref_state)
    diffs = {name: (exported[name] - ref_state[name]).abs() for name in grads}
    out["weight_diff_all"] = max(d.max().item() for d in diffs.values())
    out["weight_diff_active"] = max(d[grads[n].abs() >= ACTIVE_GRAD].max().item() for n, d in diffs.items()
                                    if (grads[n].abs() >= ACTIVE_GRAD).any())

    reloaded = AutoModelForCausalLM.from_config(hf_model.config)
    reloaded.load_state_dict(exported)
    reloaded.eval()
    after = backend.logprobs(samples, temperature=TEMPERATURE)
    with torch.no_grad():
        out["export_logprob_diff"] = _max_diff(
            after, [hf_token_logprobs(reloaded, s.token_ids, TEMPERATURE)[0] for s in samples], "logprobs")

    backend.save_checkpoint(workdir / "checkpoint", {"next_task": 7})
    # the checkpoint is also an HF model folder (rank 0 wrote it; every rank reads it back here)
    saved = AutoModelForCausalLM.from_pretrained(workdir / "checkpoint", local_files_only=True).state_dict()
    out["checkpoint_hf_keys_match"] = set(saved) == set(exported)
    out["checkpoint_hf_diff"] = max((saved[k] - exported[k]).abs().max().item() for k in exported)
    out["next_loss"] = backend.train_step(samples, loss_fn, temperature=TEMPERATURE)["loss"]
    resumed = make_backend()
    out["resumed_extra"] = resumed.load_checkpoint(workdir / "checkpoint")
    out["resumed_version"] = resumed.version
    out["resumed_next_loss"] = resumed.train_step(samples, loss_fn, temperature=TEMPERATURE)["loss"]
    out["one_sample_step_loss"] = resumed.train_step(samples[:1], loss_fn, temperature=TEMPERATURE)["loss"]
    return out
