"""One config for the algorithm, and the `LossFn` that composes the pure pieces for a backend."""

from __future__ import annotations

from typing import Literal, Self

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from relax_gym.trainer.algorithms.aggregate import Aggregation, aggregate, masked
from relax_gym.trainer.algorithms.corrections import Level, importance_mask, truncated_importance_weights
from relax_gym.trainer.algorithms.losses import (
    KLKind,
    Metrics,
    distillation_token_loss,
    entropy_bonus,
    grpo_token_loss,
    gspo_token_loss,
    kl_penalty,
    sapo_token_loss,
)
from relax_gym.trainer.batch import LossFn, MicroBatch

Algorithm = Literal["grpo", "gspo", "sapo", "distill"]

#: (clip_low, clip_high) when the config leaves them None: DAPO's clip-higher, GSPO paper's range
DEFAULT_CLIP = {"grpo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}


class AlgorithmConfig(BaseModel):
    """Everything that selects the maths of an update; the advantage options are read by the train loop.

    A pydantic model so that the training config's `algorithm:` section is this class (plus loop options)
    and each field, default and choice is written once; that section spells `algorithm` as `name`, which
    this class accepts too.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True)

    algorithm: Algorithm = Field("grpo", alias="name", description="the policy loss (`algorithm.name` in a "
                                 "training config): grpo (PPO-clipped, token level), gspo (sequence-level ratio), "
                                 "sapo (soft gates instead of a clip) or distill (toward `teacher`'s logprobs)")
    clip_low: float | None = Field(None, description="PPO clip (grpo, gspo): the ratio's lower bound is "
                                   "1 - clip_low; None = the algorithm's default in `DEFAULT_CLIP` (grpo 0.2, "
                                   "gspo 3e-4)")
    clip_high: float | None = Field(None, description="PPO clip (grpo, gspo): the ratio's upper bound is "
                                    "1 + clip_high; None = the algorithm's default in `DEFAULT_CLIP` (grpo 0.28, "
                                    "gspo 4e-4)")
    dual_clip_c: float | None = Field(None, gt=1, description="dual clip for negative advantages (grpo), c > 1; "
                                      "None = off")
    sapo_tau_pos: float = Field(1.0, gt=0, description="SAPO gate temperature for positive advantages")
    sapo_tau_neg: float = Field(1.05, gt=0, description="SAPO gate temperature for negative advantages")
    aggregation: Aggregation = Field("token-mean", description="how per-token losses become one: token-mean (every "
                                     "token of the step weighs the same, DAPO), seq-mean-token-mean (each sequence's "
                                     "token mean, GRPO), seq-mean-token-sum (each sequence's token sum, Dr.GRPO)")
    kl_coef: float = Field(0.0, ge=0, description="coefficient of the KL to the reference policy (the starting "
                           "model, run frozen beside the policy when > 0)")
    kl_kind: KLKind = Field("k3", description="the KL estimator (Schulman's): k1 = log ratio, k2 = half its square, "
                            "k3 = ratio - log ratio - 1 (unbiased, low variance, >= 0)")
    entropy_coef: float = Field(0.0, ge=0, description="coefficient of the entropy bonus")
    tis_cap: float | None = Field(None, gt=0, description="truncated importance sampling cap on π_old / π_rollout; "
                                  "None = off")
    mis_low: float | None = Field(None, description="masked importance sampling: lower bound on π_old / π_rollout "
                                  "(tokens below it are dropped); both None = off, one None = unbounded side")
    mis_high: float | None = Field(None, description="masked importance sampling: upper bound on π_old / "
                                   "π_rollout (tokens above it are dropped); both None = off, one None = unbounded "
                                   "side")
    mis_level: Level = Field("token", description="masked importance sampling per token, or per sequence (the "
                             "geometric mean of its ratios: a whole sequence is dropped at once)")
    std_normalize: bool = Field(True, description="group advantages: divide by the group std (GRPO) or not "
                                "(Dr.GRPO)")
    filter_uniform_groups: bool = Field(False, description="DAPO dynamic sampling: drop groups whose rewards are "
                                        "all equal")

    @model_validator(mode="after")
    def _combinations(self) -> Self:
        """What the field types cannot say: options that only some algorithms have, and ordered bounds."""
        if self.algorithm not in DEFAULT_CLIP and (self.clip_low, self.clip_high) != (None, None):
            raise ValueError(f"clip_low/clip_high do not apply to {self.algorithm!r}")
        if self.dual_clip_c is not None and self.algorithm != "grpo":
            raise ValueError("dual_clip_c applies to grpo only")
        if self.mis_low is not None and self.mis_high is not None and self.mis_low >= self.mis_high:
            raise ValueError("mis_low must be < mis_high")
        return self

    @property
    def clip_range(self) -> tuple[float, float]:
        """(clip_low, clip_high) of grpo / gspo, with the algorithm's defaults filled in."""
        default_low, default_high = DEFAULT_CLIP[self.algorithm]
        return (default_low if self.clip_low is None else self.clip_low,
                default_high if self.clip_high is None else self.clip_high)


def make_loss_fn(cfg: AlgorithmConfig) -> LossFn:
    """The backend's loss: policy loss × off-policy corrections + kl_coef · KL - entropy_coef · entropy.

    The ratio is taken against `old_logprobs` when the loop recomputed them, else against
    `rollout_logprobs` (so a first step on on-policy data has ratio 1 without a recompute); TIS / MIS
    weigh the policy term by π_old / π_rollout and are the identity without `old_logprobs`. Padded
    positions are zeroed with `torch.where` first, so NaN/inf there cannot reach the loss or grads.
    ``distill`` ignores `advantages` and needs `teacher_logprobs`.

    Every returned metric is normalised by the STEP totals like the loss (per-token statistics such
    as ``clip_frac`` or ``ratio`` as token-means over `step_tokens`; ``loss``, ``pg_loss``, ``kl``,
    ``entropy`` with `cfg.aggregation`), so the backend's sum over the step's micro-batches is the
    step's value. Per-token maxima are not reported since they do not add up.
    """
    mis_on = cfg.mis_low is not None or cfg.mis_high is not None

    def loss_fn(mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb.mask.bool()

        def reduce(per_token: torch.Tensor, mode: Aggregation = cfg.aggregation) -> torch.Tensor:
            return aggregate(per_token, mask, mode=mode, step_tokens=mb.step_tokens,
                             step_sequences=mb.step_sequences)

        logprobs = masked(mb.logprobs, mask)
        rollout = masked(mb.rollout_logprobs, mask)
        old = rollout if mb.old_logprobs is None else masked(mb.old_logprobs, mask)
        advantages = masked(mb.advantages, mask)

        if cfg.algorithm == "grpo":
            clip_low, clip_high = cfg.clip_range
            pg, metrics = grpo_token_loss(logprobs, old, advantages, clip_low=clip_low, clip_high=clip_high,
                                          dual_clip_c=cfg.dual_clip_c)
        elif cfg.algorithm == "gspo":
            clip_low, clip_high = cfg.clip_range
            pg, metrics = gspo_token_loss(logprobs, old, advantages, mask, clip_low=clip_low, clip_high=clip_high)
        elif cfg.algorithm == "sapo":
            pg, metrics = sapo_token_loss(logprobs, old, advantages, tau_pos=cfg.sapo_tau_pos,
                                          tau_neg=cfg.sapo_tau_neg)
        else:
            if mb.teacher_logprobs is None:
                raise ValueError("algorithm 'distill' needs teacher_logprobs in the micro-batch")
            pg, metrics = distillation_token_loss(logprobs, masked(mb.teacher_logprobs, mask), old)

        if cfg.tis_cap is not None:
            weights, tis_metrics = truncated_importance_weights(old, rollout, cap=cfg.tis_cap)
            pg, metrics = pg * weights, metrics | tis_metrics
        if mis_on:
            keep, mis_metrics = importance_mask(old, rollout, mask, level=cfg.mis_level,
                                                low=0.0 if cfg.mis_low is None else cfg.mis_low,
                                                high=torch.inf if cfg.mis_high is None else cfg.mis_high)
            pg, metrics = masked(pg, keep), metrics | mis_metrics

        loss = reduce(pg)
        report: Metrics = {"pg_loss": loss}
        if mb.ref_logprobs is not None:
            report["kl"] = reduce(kl_penalty(logprobs, masked(mb.ref_logprobs, mask), cfg.kl_kind))
            loss = loss + cfg.kl_coef * report["kl"]
        elif cfg.kl_coef > 0:
            raise ValueError("kl_coef > 0 needs ref_logprobs in the micro-batch")
        if mb.entropy is not None:
            report["entropy"] = entropy_bonus(mb.entropy, mask, mode=cfg.aggregation, step_tokens=mb.step_tokens,
                                              step_sequences=mb.step_sequences)
            loss = loss - cfg.entropy_coef * report["entropy"]
        elif cfg.entropy_coef > 0:
            raise ValueError("entropy_coef > 0 needs entropy in the micro-batch")
        report |= {name: reduce(value, "token-mean") for name, value in metrics.items()}
        report["loss"] = loss
        return loss, {name: value.item() for name, value in report.items()}

    return loss_fn


def sft_loss_fn(aggregation: Aggregation = "token-mean") -> LossFn:
    """Supervised fine-tuning on trajectories: the negative log-likelihood of their trained tokens (the policy's
    turns, under the same loss masks as RL), aggregated as RL's loss is. Advantages and the logprobs the
    demonstrations were sampled with are not read."""

    def loss_fn(mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb.mask.bool()
        nll = aggregate(-masked(mb.logprobs, mask), mask, mode=aggregation, step_tokens=mb.step_tokens,
                        step_sequences=mb.step_sequences)
        return nll, {"loss": float(nll.detach())}

    return loss_fn
