"""Per-token policy losses, KL estimators and the entropy bonus.

Every policy loss returns ``(loss [B, T], metrics)`` where `metrics` maps names to detached per-token
[B, T] tensors (e.g. ``clip_frac`` is a 0/1 indicator, ``ratio`` the importance ratio), so that one
call to `aggregate(..., mode="token-mean")` turns them into step-additive fractions and means.
Values at padded positions are unspecified: reduce with `aggregate`, which masks with `torch.where`,
and pass logprobs whose padded positions are zeroed with `masked` (as `make_loss_fn` does), since NaN
or inf there would otherwise turn the zero gradient of those positions into NaN (0 · inf).
Logprobs of the old / rollout / reference / teacher policies are taken as constants (no grad).
"""

from __future__ import annotations

from typing import Literal

import torch

from relax_gym.trainer.algorithms.aggregate import Aggregation, aggregate, masked

KLKind = Literal["k1", "k2", "k3"]
Metrics = dict[str, torch.Tensor]


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from tokens sampled from π (Schulman 2020, "Approximating KL").

    k1 = log π - log π_ref (unbiased, high variance); k2 = ½ (log π - log π_ref)² (biased, low
    variance); k3 = π_ref/π - log(π_ref/π) - 1 (unbiased, low variance, always ≥ 0).
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2 or k3")


def _ratio_metrics(ratio: torch.Tensor, logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> Metrics:
    """The ratio and KL(π_old || π_θ) (k3 on tokens sampled from π_old), how far the update has moved."""
    return {"ratio": ratio.detach(), "approx_kl": kl_penalty(old_logprobs, logprobs.detach(), "k3")}


def grpo_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                    clip_low: float = 0.2, clip_high: float = 0.28,
                    dual_clip_c: float | None = None) -> tuple[torch.Tensor, Metrics]:
    """PPO-clip surrogate per token with a decoupled range (DAPO clip-higher, arXiv:2503.14476) and dual clip.

    loss = max(-A·r, -A·clip(r, 1 - clip_low, 1 + clip_high)) with r = π_θ / π_old. A larger
    `clip_high` lets low-probability tokens with A > 0 grow (against entropy collapse). With
    `dual_clip_c` = c > 1, tokens with A < 0 have their loss capped at -c·A (Ye et al. 2020,
    arXiv:1912.09729, as in slime and veRL), so a huge ratio cannot blow up a negative update.
    """
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clip_frac": (clipped > unclipped).float()}
    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["dual_clip_frac"] = dual.float()
    return loss, metrics | _ratio_metrics(ratio, logprobs, old_logprobs)


def gspo_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, *, clip_low: float = 3e-4,
                    clip_high: float = 4e-4) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071, eq. GSPO-token).

    Sequence ratio s_i = exp(1/|y_i| Σ_t (log π_θ(y_i,t) - log π_old(y_i,t))) over the valid tokens;
    per token s_i,t = sg[s_i] · π_θ(y_i,t) / sg[π_θ(y_i,t)], whose value is s_i and whose gradient is
    s_i ∇log π_θ(y_i,t). The loss is the PPO clip of s_i,t, so a whole sequence is clipped or not.
    With ``seq-mean-token-mean`` aggregation the gradient is exactly GSPO's:
    -A_i · s_i · 1/|y_i| Σ_t ∇log π_θ(y_i,t) = -A_i ∇s_i (per sequence, before the 1/#sequences).
    The clip range is ~1e-4 because s_i is a per-token geometric mean.
    """
    logprobs, old_logprobs = masked(logprobs, mask), masked(old_logprobs, mask)
    log_ratio = logprobs - old_logprobs
    lengths = mask.bool().sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / lengths
    ratio = torch.exp(seq_log_ratio.detach() + logprobs - logprobs.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clip_frac": (clipped > unclipped).float()}
    return loss, metrics | _ratio_metrics(ratio, logprobs, old_logprobs)


def sapo_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                    tau_pos: float = 1.0, tau_neg: float = 1.05) -> tuple[torch.Tensor, Metrics]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", Qwen, arXiv:2511.20347): a soft gate for the clip.

    loss = -f(r)·A with f(r) = σ(τ (r - 1)) · 4/τ, r = π_θ / π_old, τ = tau_pos if A > 0 else tau_neg
    (paper defaults 1.0 / 1.05: negative updates, which raise many unsampled logits, decay faster).
    The gradient is -A · w(r) · r ∇log π_θ with gate weight w(r) = 4 σ(τ(r-1)) (1 - σ(τ(r-1)))
    = sech²(τ(r-1)/2): w(1) = 1, so on-policy it is the vanilla policy gradient; it decays smoothly
    as r leaves 1 instead of dropping to 0 at a hard bound. As τ → 0, w → 1 (the unclipped
    importance-weighted gradient); as τ → ∞, w → 0 for every r ≠ 1. The loss value at r = 1 is
    -2A/τ (a constant offset with no gradient), not -A as in GRPO.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    tau = torch.full_like(advantages, tau_neg).masked_fill(advantages > 0, tau_pos)
    gate = torch.sigmoid(tau * (ratio - 1))
    loss = -advantages * gate * 4 / tau
    metrics = {"gate_weight": (4 * gate * (1 - gate)).detach()}
    return loss, metrics | _ratio_metrics(ratio, logprobs, old_logprobs)


def distillation_token_loss(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                            old_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """On-policy distillation: reverse KL to the teacher on the student's own samples, as a policy gradient.

    Per-token advantage A = log π_teacher - log π_sampler (detached; the negative per-token reverse
    KL), trained with the importance-weighted loss -A · π_θ/π_sampler (Thinking Machines, "On-Policy
    Distillation", 2025; Qwen3 technical report, arXiv:2505.09388). `old_logprobs` is the sampling
    policy's; without it the current policy is (ratio 1). Its gradient is that of
    KL(π_θ || π_teacher) on the sampled tokens, zero where student and teacher agree.
    """
    sampler = logprobs.detach() if old_logprobs is None else old_logprobs
    advantages = teacher_logprobs - sampler
    ratio = torch.exp(logprobs - sampler)
    metrics = {"reverse_kl": -advantages.detach()}
    return -advantages * ratio, metrics | _ratio_metrics(ratio, logprobs, sampler)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, *, mode: Aggregation, step_tokens: int,
                  step_sequences: int) -> torch.Tensor:
    """Aggregated policy entropy; the loss subtracts it × a coefficient against entropy collapse (PPO, 1707.06347)."""
    return aggregate(entropy, mask, mode=mode, step_tokens=step_tokens, step_sequences=step_sequences)
