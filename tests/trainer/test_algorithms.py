"""relax_gym.trainer.algorithms against values worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from relax_gym.trainer.algorithms import (
    AGGREGATIONS,
    AlgorithmConfig,
    aggregate,
    distillation_token_loss,
    filter_uniform_groups,
    group_advantages,
    grpo_token_loss,
    gspo_token_loss,
    importance_mask,
    kl_penalty,
    make_loss_fn,
    sapo_token_loss,
    truncated_importance_weights,
)
from relax_gym.trainer.batch import MicroBatch

NAN = float("nan")
LN2 = math.log(2)
SIGMOID_1 = 1 / (1 + math.exp(-1))  # σ(1) = 0.7310585786


def t(values, **kw) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, **kw)


def leaf(values) -> torch.Tensor:
    return t(values, requires_grad=True)


def close(actual: torch.Tensor, expected, atol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, t(expected) if not isinstance(expected, torch.Tensor) else expected,
                               atol=atol, rtol=0, check_dtype=False)


def micro_batch(logprobs, mask, *, advantages, rollout, old=None, ref=None, teacher=None, entropy=None,
                step_tokens: int, step_sequences: int) -> MicroBatch:
    return MicroBatch(logprobs=logprobs, entropy=entropy, mask=mask, advantages=advantages,
                      rollout_logprobs=rollout, old_logprobs=old, ref_logprobs=ref, teacher_logprobs=teacher,
                      step_tokens=step_tokens, step_sequences=step_sequences)


# ---------------------------------------------------------------- advantages


def test_group_advantages_with_std() -> None:
    # group a: [1, 0]: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.70711 -> ±0.5 / 0.70711 = ±0.70711
    # group b: [2, 4, 6]: mean 4, unbiased std sqrt((4 + 0 + 4) / 2) = 2 -> [-1, 0, 1]
    adv = group_advantages(t([1, 0, 2, 4, 6]), ["a", "a", "b", "b", "b"])
    close(adv, [1 / math.sqrt(2), -1 / math.sqrt(2), -1, 0, 1], atol=1e-5)


def test_group_advantages_without_std_is_dr_grpo() -> None:
    # reward minus group mean only: a: [0.5, -0.5]; b: [-2, 0, 2]
    adv = group_advantages(t([1, 0, 2, 4, 6]), ["a", "a", "b", "b", "b"], std_normalize=False)
    close(adv, [0.5, -0.5, -2, 0, 2])


def test_group_advantages_tensor_ids_interleaved_and_singleton() -> None:
    # ids 7, 3, 7, 9: group 7 = rewards [1, 3] (mean 2, std sqrt(2)), group 3 = [5] alone -> 0, group 9 = [0] -> 0
    adv = group_advantages(t([1, 5, 3, 0]), torch.tensor([7, 3, 7, 9]))
    close(adv, [-1 / math.sqrt(2), 0, 1 / math.sqrt(2), 0], atol=1e-5)
    # integer rewards work the same
    close(group_advantages(torch.tensor([1, 5, 3, 0]), [7, 3, 7, 9], std_normalize=False), [-1, 0, 1, 0])


def test_group_advantages_of_one_sample_or_none() -> None:
    close(group_advantages(torch.tensor([3]), ["task"], std_normalize=True), [0])  # one sample: advantage 0
    assert group_advantages(t([]), []).numel() == 0


def test_group_advantages_rejects_length_mismatch() -> None:
    with pytest.raises(ValueError, match="group ids"):
        group_advantages(t([1, 0]), ["a"])


def test_filter_uniform_groups() -> None:
    # a: [1, 1] all equal -> drop; b: [0, 1] -> keep; c: [0.5] (one sample, trivially uniform) -> drop
    keep = filter_uniform_groups(t([1, 1, 0, 1, 0.5]), ["a", "a", "b", "b", "c"])
    assert keep.tolist() == [False, False, True, True, False]


# ---------------------------------------------------------------- GRPO


def test_grpo_clip_higher_values_and_gradients() -> None:
    # token: ratio r, advantage A -> loss = max(-A r, -A clip(r, 0.8, 1.28)), d loss / d logp
    #   0: r=1.5,  A=+1: -1.5 vs -1.28 -> -1.28 (clipped above 1+clip_high), grad 0
    #   1: r=0.5,  A=-1:  0.5 vs  0.8  ->  0.8  (clipped below 1-clip_low),  grad 0
    #   2: r=1.25, A=+1: in [0.8, 1.28] (a symmetric 0.2 clip would cut it) -> -1.25, grad -A r = -1.25
    #   3: r=0.5,  A=+1: -0.5 vs -0.8 -> -0.5 (pessimistic side: unclipped), grad -0.5
    #   4: r=1.5,  A=-1:  1.5 vs 1.28 ->  1.5 (unclipped), grad +1.5
    ratios = [1.5, 0.5, 1.25, 0.5, 1.5]
    logprobs = leaf([[math.log(r) for r in ratios]])
    advantages = t([[1, -1, 1, 1, -1]])
    loss, metrics = grpo_token_loss(logprobs, torch.zeros_like(logprobs), advantages)
    close(loss, [[-1.28, 0.8, -1.25, -0.5, 1.5]])
    close(metrics["clip_frac"], [[1, 1, 0, 0, 0]])
    close(metrics["ratio"], [ratios])
    loss.sum().backward()
    close(logprobs.grad, [[0, 0, -1.25, -0.5, 1.5]])


def test_grpo_dual_clip_bounds_negative_advantages() -> None:
    # A=-1, r=e^2=7.389: plain loss max(7.389, 0.8) = 7.389; dual clip c=3 caps it at -c A = 3, grad 0
    # A=-1, r=2: loss 2 < 3 stays, grad -A r = 2; A=+1, r=e^2: dual clip ignores A > 0 -> -1.28, grad 0
    logprobs = leaf([[2.0, LN2, 2.0]])
    advantages = t([[-1, -1, 1]])
    plain, _ = grpo_token_loss(logprobs.detach(), torch.zeros(1, 3), advantages)
    close(plain, [[math.exp(2), 2, -1.28]], atol=1e-6)
    loss, metrics = grpo_token_loss(logprobs, torch.zeros(1, 3), advantages, dual_clip_c=3.0)
    close(loss, [[3, 2, -1.28]], atol=1e-6)
    close(metrics["dual_clip_frac"], [[1, 0, 0]])
    loss.sum().backward()
    close(logprobs.grad, [[0, 2, 0]], atol=1e-6)
    with pytest.raises(ValueError, match="> 1"):
        grpo_token_loss(logprobs, torch.zeros(1, 3), advantages, dual_clip_c=1.0)


# ---------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_and_gradient_match_the_paper() -> None:
    # old logprobs 0, so logp - old = logp; clip range [0.8, 1.2]; 3 sequences, seq-mean-token-mean over 3
    #   seq 0: [0.1, -0.1 | pad], A=+1:   s = exp(0/2) = 1                  -> token loss -1
    #   seq 1: [0.3, 0, 0],       A=-0.5: s = exp(0.3/3) = e^0.1 = 1.10517   -> token loss 0.5 e^0.1 = 0.55259
    #   seq 2: [0.6, 0.6 | pad],  A=+1:   s = e^0.6 = 1.82212 > 1.2, clipped -> token loss -1.2
    # GSPO gradient (unclipped): d/d logp_t of (1/3) Σ_i 1/|y_i| Σ_t -A_i s_{i,t} = -A_i s_i / (3 |y_i|)
    #   seq 0: -1 / 6; seq 1: 0.5 e^0.1 / 9 = 0.061398; seq 2 clipped: 0; padding: 0
    logprobs = leaf([[0.1, -0.1, NAN], [0.3, 0.0, 0.0], [0.6, 0.6, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
    advantages = t([[1, 1, 1], [-0.5, -0.5, -0.5], [1, 1, 1]])
    loss, metrics = gspo_token_loss(logprobs, torch.zeros(3, 3), advantages, mask, clip_low=0.2, clip_high=0.2)
    e01, e06 = math.exp(0.1), math.exp(0.6)
    close(metrics["ratio"] * mask, [[1, 1, 0], [e01, e01, e01], [e06, e06, 0]])
    close(metrics["clip_frac"] * mask, [[0, 0, 0], [0, 0, 0], [1, 1, 0]])
    total = aggregate(loss, mask, mode="seq-mean-token-mean", step_tokens=8, step_sequences=3)
    close(total, (-1 + 0.5 * e01 - 1.2) / 3)
    total.backward()
    close(logprobs.grad, [[-1 / 6, -1 / 6, 0], [0.5 * e01 / 9] * 3, [0, 0, 0]])


def test_gspo_gradient_is_a_times_grad_of_sequence_ratio() -> None:
    # with one sequence and 1/|y| token averaging, d loss / d logp = -A d s / d logp, s = exp(mean(logp - old))
    logprobs = leaf([[-0.5, -1.0, -0.25, -2.0]])
    old = t([[-0.5002, -0.9999, -0.2501, -2.0001]])
    mask = torch.ones(1, 4)
    loss, _ = gspo_token_loss(logprobs, old, t([[0.7] * 4]), mask)
    aggregate(loss, mask, mode="seq-mean-token-mean", step_tokens=4, step_sequences=1).backward()
    s = torch.exp((logprobs.detach() - old).mean())  # = exp(0.0001 / 4) -> in [1 - 3e-4, 1 + 4e-4]
    close(logprobs.grad, -0.7 * s / 4 * torch.ones(1, 4))


# ---------------------------------------------------------------- SAPO


def test_sapo_gate_values() -> None:
    # f(r) = σ(τ (r - 1)) 4/τ; loss = -A f(r)
    #   r=1, A=+1, τ_pos=1:    f = 0.5 · 4 = 2            -> -2
    #   r=1, A=-1, τ_neg=1.05: f = 0.5 · 4 / 1.05 = 1.90476 -> +1.90476
    #   r=2, A=+1, τ_pos=1:    f = 4 σ(1) = 2.92423       -> -2.92423; gate weight 4 σ(1)(1 - σ(1)) = 0.78645
    logprobs = leaf([[0.0, 0.0, LN2]])
    loss, metrics = sapo_token_loss(logprobs, torch.zeros(1, 3), t([[1, -1, 1]]))
    close(loss, [[-2, 2 / 1.05, -4 * SIGMOID_1]])
    close(metrics["gate_weight"], [[1, 1, 4 * SIGMOID_1 * (1 - SIGMOID_1)]])
    # d loss / d logp = -A · 4σ(1-σ) · r: [-1, +1, -0.78645 · 2 = -1.57290]
    loss.sum().backward()
    close(logprobs.grad, [[-1, 1, -2 * 4 * SIGMOID_1 * (1 - SIGMOID_1)]])


def test_sapo_on_policy_gradient_is_vanilla_policy_gradient() -> None:
    # at r = 1 the gate weight is 4 σ(0)(1 - σ(0)) = 1 for any τ: d loss / d logp = -A
    advantages = t([[1.5, -0.3, 0.0, -2.0]])
    logprobs = leaf([[-0.1, -2.0, -0.7, -3.0]])
    loss, _ = sapo_token_loss(logprobs, logprobs.detach(), advantages, tau_pos=0.3, tau_neg=7.0)
    loss.sum().backward()
    close(logprobs.grad, -advantages)


def test_sapo_temperature_limits() -> None:
    # τ → 0: gate weight sech²(τ(r-1)/2) → 1, so the gradient is the unclipped importance-weighted -A r
    ratios = t([[0.5, 2.0, 5.0]])
    advantages = t([[1.0, 1.0, -1.0]])
    logprobs = ratios.log().requires_grad_()
    loss, _ = sapo_token_loss(logprobs, torch.zeros(1, 3), advantages, tau_pos=1e-6, tau_neg=1e-6)
    loss.sum().backward()
    close(logprobs.grad, -advantages * ratios, atol=1e-6)
    # τ → ∞: the weight vanishes off r = 1 (a hard trust region) but stays 1 at r = 1
    logprobs = leaf([[math.log(0.5), math.log(2.0), 0.0]])
    loss, _ = sapo_token_loss(logprobs, torch.zeros(1, 3), advantages, tau_pos=100.0, tau_neg=100.0)
    loss.sum().backward()
    close(logprobs.grad, [[0, 0, 1]], atol=1e-12)


# ---------------------------------------------------------------- distillation


def test_distillation_advantages_and_loss() -> None:
    # advantage = teacher - student (detached): [-1 - (-1.5), -2 - (-2)] = [0.5, 0]; ratio 1 -> loss -A
    logprobs = leaf([[-1.5, -2.0]])
    loss, metrics = distillation_token_loss(logprobs, t([[-1.0, -2.0]]))
    close(loss, [[-0.5, 0]])
    close(metrics["reverse_kl"], [[-0.5, 0]])
    loss.sum().backward()
    close(logprobs.grad, [[-0.5, 0]])


def test_distillation_with_sampler_logprobs_is_importance_weighted() -> None:
    # sampler -1.5, current -1.5 + ln2 -> ratio 2; advantage = teacher - sampler = 0.5 -> loss -1, grad -A r = -1
    logprobs = leaf([[-1.5 + LN2]])
    loss, _ = distillation_token_loss(logprobs, t([[-1.0]]), t([[-1.5]]))
    close(loss, [[-1.0]])
    loss.sum().backward()
    close(logprobs.grad, [[-1.0]])


def test_distillation_gradient_vanishes_when_student_equals_teacher() -> None:
    logprobs = leaf([[-0.3, -1.7, -4.0]])
    loss, _ = distillation_token_loss(logprobs, logprobs.detach().clone())
    loss.sum().backward()
    close(logprobs.grad, torch.zeros(1, 3))


# ---------------------------------------------------------------- KL, corrections


def test_kl_estimators() -> None:
    # logp = log 0.5, ref = log 0.25 -> logp - ref = ln 2
    # k1 = ln2 = 0.69315; k2 = ln2² / 2 = 0.24023; k3 = 0.5 - (-ln2) - 1 = ln2 - 0.5 = 0.19315
    logp, ref = t([math.log(0.5)]), t([math.log(0.25)])
    close(kl_penalty(logp, ref, "k1"), [LN2])
    close(kl_penalty(logp, ref, "k2"), [LN2**2 / 2])
    close(kl_penalty(logp, ref, "k3"), [LN2 - 0.5])
    close(kl_penalty(ref, ref, "k3"), [0.0])
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_k3_is_non_negative() -> None:
    generator = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(1000, generator=generator) * 3, torch.randn(1000, generator=generator) * 3
    assert (kl_penalty(logp, ref, "k3") >= 0).all()


def test_truncated_importance_weights_cap() -> None:
    # old - rollout = [ln 3, ln 0.5, 0] -> π_old / π_rollout = [3, 0.5, 1] -> capped at 2: [2, 0.5, 1]
    old = leaf([[math.log(3), math.log(0.5), 0.0]])
    weights, metrics = truncated_importance_weights(old, torch.zeros(1, 3), cap=2.0)
    close(weights, [[2, 0.5, 1]])
    close(metrics["tis_capped"], [[1, 0, 0]])
    assert not weights.requires_grad


def test_importance_mask_token_level() -> None:
    # ratios [3, 0.5, 1 | pad NaN], kept in [0.6, 2]: [no, no, yes | never]
    old = t([[math.log(3), math.log(0.5), 0.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 0]])
    keep, metrics = importance_mask(old, torch.zeros(1, 4), mask, low=0.6, high=2.0, level="token")
    assert keep.tolist() == [[False, False, True, False]]
    close(metrics["mis_masked"], [[1, 1, 0, 0]])


def test_importance_mask_sequence_level() -> None:
    # seq 0: ratios [2, 2] -> geometric mean 2 > 1.5: whole sequence dropped
    # seq 1: ratios [2, 0.5 | pad NaN] -> geometric mean sqrt(2 · 0.5) = 1: kept (padding not), although the
    #        token-level ratios 2 and 0.5 are both outside [0.5 + ε, 1.5]
    old = t([[LN2, LN2, 0.0], [LN2, -LN2, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    keep, metrics = importance_mask(old, torch.zeros(2, 3), mask, low=0.6, high=1.5, level="sequence")
    assert keep.tolist() == [[False, False, False], [True, True, False]]
    close(metrics["mis_masked"], [[1, 1, 0], [0, 0, 0]])
    with pytest.raises(ValueError):
        importance_mask(old, torch.zeros(2, 3), mask, low=0.6, high=1.5, level="batch")  # type: ignore[arg-type]


# ---------------------------------------------------------------- aggregation

LOSS_2X3 = [[1.0, 2.0, NAN], [4.0, 1e30, NAN]]
MASK_2X3 = [[1, 1, 0], [1, 0, 0]]


@pytest.mark.parametrize(("mode", "expected"), [
    ("token-mean", (1 + 2 + 4) / 3),  # 7 / 3 tokens
    ("seq-mean-token-mean", (1.5 + 4) / 2),  # means 1.5 and 4 over 2 sequences = 2.75
    ("seq-mean-token-sum", (3 + 4) / 2),  # sums 3 and 4 over 2 sequences = 3.5
])
def test_aggregate_modes_on_2x3(mode: str, expected: float) -> None:
    # NaN and 1e30 in padded positions must not leak
    value = aggregate(t(LOSS_2X3), torch.tensor(MASK_2X3), mode=mode, step_tokens=3, step_sequences=2)
    close(value, expected)


def test_aggregate_normalises_by_step_totals() -> None:
    # this micro-batch is half of a step with 6 tokens / 4 sequences: 7 / 6 and (1.5 + 4) / 4
    mask = torch.tensor(MASK_2X3)
    close(aggregate(t(LOSS_2X3), mask, mode="token-mean", step_tokens=6, step_sequences=4), 7 / 6)
    close(aggregate(t(LOSS_2X3), mask, mode="seq-mean-token-mean", step_tokens=6, step_sequences=4), 5.5 / 4)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(t(LOSS_2X3), mask, mode="sum", step_tokens=6, step_sequences=4)  # type: ignore[arg-type]


def pad(rows: list[torch.Tensor], value: float = NAN) -> torch.Tensor:
    return pad_sequence(rows, batch_first=True, padding_value=value)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_micro_batches_sum_to_the_batch(mode: str) -> None:
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 1, 3, 7, 2]
    values = [torch.randn(n, generator=generator, dtype=torch.float64) for n in lengths]
    masks = [torch.ones(n) for n in lengths]
    masks[2][0] = 0  # a prompt position inside a sequence
    totals = {"step_tokens": int(sum(m.sum() for m in masks)), "step_sequences": len(lengths)}

    def over(rows: slice) -> torch.Tensor:  # each micro-batch padded to its own longest sequence
        return aggregate(pad(values[rows]), pad(masks[rows], 0), mode=mode, **totals)

    whole = over(slice(0, 5))
    for split in ([slice(0, 2), slice(2, 5)], [slice(0, 1), slice(1, 4), slice(4, 5)]):
        close(sum(over(part) for part in split), whole, atol=1e-12)


# ---------------------------------------------------------------- make_loss_fn


def on_policy_batch(step_tokens: int = 3, step_sequences: int = 2, **extra) -> tuple[MicroBatch, torch.Tensor]:
    # 2 sequences, position 0 is the prompt; valid tokens: seq 0 at t=1,2 (A=1), seq 1 at t=1 (A=-0.5).
    # Padded / prompt positions hold NaN or huge numbers that must not leak into the loss or the grads.
    logprobs = leaf([[NAN, -1.0, -2.0], [NAN, -0.5, NAN]])
    rollout = t([[1e4, -1.0, -2.0], [-1e4, -0.5, 1e30]])
    mb = micro_batch(logprobs, torch.tensor([[0, 1, 1], [0, 1, 0]]), advantages=t([[NAN, 1, 1], [NAN, -0.5, NAN]]),
                     rollout=rollout, step_tokens=step_tokens, step_sequences=step_sequences, **extra)
    return mb, logprobs


def test_make_loss_fn_grpo_on_policy_token_mean() -> None:
    # ratio 1 everywhere -> per-token loss -A; token-mean = -(1 + 1 - 0.5) / 3 = -0.5; d loss / d logp = -A / 3
    mb, logprobs = on_policy_batch()
    loss, metrics = make_loss_fn(AlgorithmConfig())(mb)
    close(loss, -0.5)
    assert metrics["loss"] == pytest.approx(-0.5) and metrics["pg_loss"] == pytest.approx(-0.5)
    assert metrics["ratio"] == pytest.approx(1.0) and metrics["clip_frac"] == 0 and metrics["approx_kl"] == 0
    assert all(isinstance(v, float) for v in metrics.values())
    loss.backward()
    close(logprobs.grad, [[0, -1 / 3, -1 / 3], [0, 0.5 / 3, 0]])


def test_make_loss_fn_grpo_on_policy_seq_mean_token_mean() -> None:
    # sequence means -1 and +0.5 over 2 sequences: -0.25; grads -1/(2·2) per token of seq 0, +0.5/2 for seq 1
    mb, logprobs = on_policy_batch()
    loss, _ = make_loss_fn(AlgorithmConfig(aggregation="seq-mean-token-mean"))(mb)
    close(loss, -0.25)
    loss.backward()
    close(logprobs.grad, [[0, -0.25, -0.25], [0, 0.25, 0]])


def test_make_loss_fn_kl_and_entropy_terms() -> None:
    # ref = logp - ln2 on valid tokens -> k1 = ln2 per token, token-mean ln2; entropy [1, 2], [3] -> 6 / 3 = 2
    # loss = -0.5 + 0.1 ln2 - 0.01 · 2 = -0.45069
    ref = t([[NAN, -1.0 - LN2, -2.0 - LN2], [1e30, -0.5 - LN2, NAN]])
    entropy = leaf([[NAN, 1.0, 2.0], [NAN, 3.0, NAN]])
    mb, logprobs = on_policy_batch(ref=ref, entropy=entropy)
    cfg = AlgorithmConfig(kl_coef=0.1, kl_kind="k1", entropy_coef=0.01)
    loss, metrics = make_loss_fn(cfg)(mb)
    close(loss, -0.5 + 0.1 * LN2 - 0.02)
    assert metrics["kl"] == pytest.approx(LN2) and metrics["entropy"] == pytest.approx(2.0)
    loss.backward()
    # d/d logp: -A/3 + 0.1/3 (k1 = logp - ref); d/d entropy: -0.01/3 on valid positions
    close(logprobs.grad, [[0, -0.9 / 3, -0.9 / 3], [0, 0.6 / 3, 0]])
    close(entropy.grad, [[0, -0.01 / 3, -0.01 / 3], [0, -0.01 / 3, 0]])


def test_make_loss_fn_corrections() -> None:
    # logp = old (ratio 1), A = 1; old - rollout = [ln 4, ln 0.5, 0]
    # TIS cap 2: weights [2, 0.5, 1] -> loss -(2 + 0.5 + 1) / 3; MIS [0.6, 3]: keeps only token 2 -> -1/3
    logprobs = leaf([[-1.0, -2.0, -3.0]])
    old = logprobs.detach().clone()
    rollout = old - t([[math.log(4), math.log(0.5), 0.0]])
    mb = micro_batch(logprobs, torch.ones(1, 3), advantages=torch.ones(1, 3), rollout=rollout, old=old,
                     step_tokens=3, step_sequences=1)
    loss, metrics = make_loss_fn(AlgorithmConfig(tis_cap=2.0))(mb)
    close(loss, -3.5 / 3)
    assert metrics["tis_capped"] == pytest.approx(1 / 3) and metrics["tis_weight"] == pytest.approx(3.5 / 3)
    loss, metrics = make_loss_fn(AlgorithmConfig(mis_low=0.6, mis_high=3.0))(mb)
    close(loss, -1 / 3)
    assert metrics["mis_masked"] == pytest.approx(2 / 3)
    loss, _ = make_loss_fn(AlgorithmConfig(tis_cap=2.0, mis_low=0.6, mis_high=3.0))(mb)
    close(loss, -1 / 3)
    loss.backward()
    close(logprobs.grad, [[0, 0, -1 / 3]])


def test_make_loss_fn_prefers_old_over_rollout_logprobs() -> None:
    # rollout far away (would be clipped), old = logp -> ratio 1 against old: loss = -A = -1
    logprobs = leaf([[-1.0]])
    mb = micro_batch(logprobs, torch.ones(1, 1), advantages=torch.ones(1, 1), rollout=t([[-5.0]]),
                     old=logprobs.detach().clone(), step_tokens=1, step_sequences=1)
    close(make_loss_fn(AlgorithmConfig())(mb)[0], -1.0)
    mb.old_logprobs = None  # ratio e^4 against the rollout, clipped at 1.28
    close(make_loss_fn(AlgorithmConfig())(mb)[0], -1.28)


def test_make_loss_fn_distill_uses_teacher_and_ignores_advantages() -> None:
    # valid tokens: student [-1, -2], [-0.5]; teacher [-0.5, -2], [-1.5] -> A = [0.5, 0], [-1]; ratio 1
    # token-mean loss = -(0.5 + 0 - 1) / 3 = 1/6; reverse KL (student - teacher = -A) token-mean: +1/6
    teacher = t([[NAN, -0.5, -2.0], [NAN, -1.5, NAN]])
    mb, logprobs = on_policy_batch(teacher=teacher)
    loss, metrics = make_loss_fn(AlgorithmConfig(algorithm="distill"))(mb)
    close(loss, 1 / 6)
    assert metrics["reverse_kl"] == pytest.approx(1 / 6)
    loss.backward()
    close(logprobs.grad, [[0, -0.5 / 3, 0], [0, 1 / 3, 0]])


def test_make_loss_fn_sapo_and_gspo_on_policy() -> None:
    # SAPO at r = 1: per-token loss -2A/τ (τ_pos = 1 for A > 0, τ_neg = 1.05 for A < 0): -(2 + 2 - 1/1.05) / 3
    mb, logprobs = on_policy_batch()
    loss, metrics = make_loss_fn(AlgorithmConfig(algorithm="sapo"))(mb)
    close(loss, -(4 - 1 / 1.05) / 3)
    assert metrics["gate_weight"] == pytest.approx(1.0)
    loss.backward()
    close(logprobs.grad, [[0, -1 / 3, -1 / 3], [0, 0.5 / 3, 0]])  # the vanilla gradient, as GRPO's
    # GSPO at s = 1: -A per token like GRPO
    mb, logprobs = on_policy_batch()
    close(make_loss_fn(AlgorithmConfig(algorithm="gspo"))(mb)[0], -0.5)


def test_make_loss_fn_missing_inputs_raise() -> None:
    mb, _ = on_policy_batch()
    with pytest.raises(ValueError, match="teacher_logprobs"):
        make_loss_fn(AlgorithmConfig(algorithm="distill"))(mb)
    with pytest.raises(ValueError, match="ref_logprobs"):
        make_loss_fn(AlgorithmConfig(kl_coef=0.1))(mb)
    with pytest.raises(ValueError, match="entropy"):
        make_loss_fn(AlgorithmConfig(entropy_coef=0.1))(mb)


def test_algorithm_config_defaults_and_validation() -> None:
    assert AlgorithmConfig().clip_range == (0.2, 0.28)
    assert AlgorithmConfig(algorithm="gspo").clip_range == (3e-4, 4e-4)
    assert AlgorithmConfig(algorithm="gspo", clip_high=5e-4).clip_range == (3e-4, 5e-4)
    for bad in ({"algorithm": "ppo"}, {"aggregation": "sum"}, {"kl_kind": "k4"}, {"mis_level": "batch"},
                {"algorithm": "sapo", "clip_low": 0.1}, {"dual_clip_c": 0.5}, {"algorithm": "gspo", "dual_clip_c": 3},
                {"sapo_tau_neg": 0.0}, {"kl_coef": -1.0}, {"tis_cap": 0.0}, {"mis_low": 2.0, "mis_high": 1.0}):
        with pytest.raises(ValueError):
            AlgorithmConfig(**bad)


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "sapo", "distill"])
def test_make_loss_fn_micro_batches_add_up(algorithm: str, mode: str) -> None:
    # The loss, the gradients and every metric of a batch equal the sums over any micro-batching of it.
    generator = torch.Generator().manual_seed(2)
    lengths = [6, 2, 4, 5]

    def randn(n: int, scale: float) -> torch.Tensor:
        return torch.randn(n, generator=generator, dtype=torch.float64) * scale

    logprobs = [(-randn(n, 1).abs()).requires_grad_() for n in lengths]
    old = [lp.detach() + randn(len(lp), 0.2) for lp in logprobs]
    old[1] = logprobs[1].detach() - 1.5  # ratio e^1.5 > 3 with A = -1: dual-clipped (grpo), clipped (gspo)
    rollout = [o + randn(len(o), 0.3) for o in old]
    rollout[2] = old[2] - 1.0  # π_old / π_rollout = e > 2 on every token: MIS drops the whole sequence
    ref = [lp.detach() + randn(len(lp), 0.1) for lp in logprobs]
    teacher = [lp.detach() + randn(len(lp), 0.5) for lp in logprobs]
    entropy = [randn(n, 1).abs() for n in lengths]
    per_sequence = zip(lengths, [1.0, -1.0, 0.5, -0.25], strict=True)
    advantages = [torch.full((n,), a, dtype=torch.float64) for n, a in per_sequence]
    masks = [torch.ones(n) for n in lengths]
    masks[0][:2] = 0  # prompt tokens
    masks[3][2] = 0  # an env observation between turns
    extra = {"dual_clip_c": 3.0} if algorithm == "grpo" else {}
    cfg = AlgorithmConfig(algorithm=algorithm, aggregation=mode, kl_coef=0.05, entropy_coef=0.01, tis_cap=1.5,
                          mis_low=0.5, mis_high=2.0, mis_level="sequence", **extra)
    loss_fn = make_loss_fn(cfg)
    totals = {"step_tokens": int(sum(m.sum() for m in masks)), "step_sequences": len(lengths)}

    def run(rows: slice) -> tuple[torch.Tensor, dict[str, float], list[torch.Tensor]]:
        for lp in logprobs:
            lp.grad = None
        mb = micro_batch(pad(logprobs[rows]), pad(masks[rows], 0), advantages=pad(advantages[rows]),
                         rollout=pad(rollout[rows]), old=pad(old[rows]), ref=pad(ref[rows]),
                         teacher=pad(teacher[rows]), entropy=pad(entropy[rows]), **totals)
        loss, metrics = loss_fn(mb)
        loss.backward()
        return loss.detach(), metrics, [lp.grad.clone() for lp in logprobs[rows]]

    whole_loss, whole_metrics, whole_grads = run(slice(0, 4))
    assert torch.isfinite(whole_loss) and whole_metrics["mis_masked"] > 0 and whole_metrics["tis_capped"] > 0
    if algorithm == "grpo":
        assert whole_metrics["dual_clip_frac"] > 0
    parts = [run(rows) for rows in (slice(0, 1), slice(1, 3), slice(3, 4))]
    close(sum(p[0] for p in parts), whole_loss, atol=1e-12)
    for name, value in whole_metrics.items():
        assert sum(p[1][name] for p in parts) == pytest.approx(value, abs=1e-12), name
    for got, want in zip([g for p in parts for g in p[2]], whole_grads, strict=True):
        close(got, want, atol=1e-12)
