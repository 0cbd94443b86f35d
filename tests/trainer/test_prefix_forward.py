"""The training forward that runs a shared prefix once: its plan, and the same loss and gradients as the plain
forward on the model families' real architectures."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from support.families import FAMILIES

from relax_gym.engines.continuous import supports_continuous_batching
from relax_gym.models import load_model
from relax_gym.trainer.backends import MicroBatch, Sample, TorchBackend
from relax_gym.trainer.backends.prefix_forward import MIN_TOKENS_SAVED, Run, plan_runs

SYSTEM = list(range(3, 23))  # 20 tokens every sample begins with, as a chat template's system turn


def _group(rng: random.Random, vocab: int, size: int, prompt_tokens: int) -> list[list[int]]:
    """`size` samples of one prompt (the system turn, then the prompt's own tokens), each with its own answer."""
    prompt = SYSTEM + [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
    return [prompt + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))] for _ in range(size)]


def _masks(rows: list[list[int]], trained_from: int) -> list[list[int]]:
    return [[0] * trained_from + [1] * (len(r) - trained_from) for r in rows]


def test_each_group_is_a_run_of_its_whole_prompt_not_one_run_of_the_system_turn():
    rng = random.Random(0)
    groups = [_group(rng, 500, 4, 30) for _ in range(3)]
    rows = [r for g in groups for r in g]
    runs = plan_runs(rows, _masks(rows, 50))
    # the prefix stops one token before the first trained token (token 50), whose logits the suffix pass computes
    assert runs == [Run(0, 4, 49), Run(4, 8, 49), Run(8, 12, 49)]


def test_the_prefix_stops_before_the_first_trained_token_and_never_takes_a_last_token():
    rows = [SYSTEM + [7, 8, 9, 10] * 10] * 4
    # a turn trained early (token 30 of a multi-turn sample): the prefix is 29 tokens, whatever follows is shared
    assert plan_runs(rows, [[0] * 30 + [1] * 30] + [[0] * 40 + [1] * 20] * 3) == [Run(0, 4, 29)]
    # the same sample, nothing trained: every token but the last can be shared
    assert plan_runs(rows, [[0] * 60] * 4) == [Run(0, 4, 59)]


def test_samples_that_share_too_little_keep_the_plain_forward():
    rng = random.Random(1)
    rows = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(8)]
    assert plan_runs(rows, _masks(rows, 20)) is None
    short = [[*SYSTEM[:8], 1, 2], [*SYSTEM[:8], 2, 1]] * 4  # 8 samples, 8 shared tokens each
    assert MIN_TOKENS_SAVED > 7 * 8 and plan_runs(short, _masks(short, 9)) is None
    # a lone sample between two groups is a run of its own, with no prefix
    rows = [*_group(rng, 500, 3, 40), [9] * 70, *_group(rng, 500, 3, 40)]
    runs = plan_runs(rows, _masks(rows, 61))
    assert runs is not None and runs[1] == Run(3, 4, 0) and runs[0].prefix == runs[2].prefix == 60


def _pg_loss(mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    return -(mb.logprobs * mb.advantages * mb.mask).sum() / mb.step_tokens, {}


def _samples(vocab: int) -> list[Sample]:
    """Three GRPO groups of one turn, a lone sample between two of them, and a two-turn sample twice, whose second
    prompt is not trained."""
    rng = random.Random(2)
    rows, masks = [], []
    for _ in range(3):
        prompt = rng.randint(12, 30)
        group = _group(rng, vocab, 4, prompt)
        rows += group
        masks += _masks(group, len(SYSTEM) + prompt)
    lone = [rng.randrange(3, vocab) for _ in range(25)]  # shares nothing: a run of its own, with no prefix
    rows.insert(4, lone)
    masks.insert(4, [0] * 20 + [1] * 5)
    turn = SYSTEM + [rng.randrange(3, vocab) for _ in range(30)]
    rows.append(turn)
    masks.append([0] * 25 + [1] * 5 + [0] * 10 + [1] * 10)
    masks[-1] = masks[-1][: len(turn)]
    rows.append(list(turn))
    masks.append(list(masks[-1]))
    return [Sample(r, m, [0.0] * len(r), advantage=rng.uniform(-1, 1)) for r, m in zip(rows, masks, strict=True)]


def _step(backend: TorchBackend, samples: list[Sample], share: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's trained logprobs and the gradients of a policy-gradient loss, by either forward."""
    backend._shares_prefixes = share
    backend.model.train()
    backend.model.zero_grad(set_to_none=True)
    step_tokens = sum(sum(s.loss_mask) for s in samples)
    mb = backend._micro_batch(samples, 0.8, step_tokens, len(samples))
    loss, _ = _pg_loss(mb)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    return (mb.logprobs * mb.mask).detach(), grads


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5", "llama3", "mistral"])
def test_the_shared_prefix_forward_gives_the_plain_forwards_logprobs_and_gradients(family):
    loaded = FAMILIES[family].loaded()
    backend = TorchBackend(copy.deepcopy(loaded), micro_batch_tokens=1 << 20)
    assert backend._shares_prefixes
    samples = _samples(loaded.model.config.vocab_size)
    runs = plan_runs([s.token_ids for s in samples], [s.loss_mask for s in samples])
    assert runs is not None and Run(4, 5, 0) in runs
    plain_logprobs, plain = _step(backend, samples, share=False)
    shared_logprobs, shared = _step(backend, samples, share=True)
    assert (shared_logprobs != 0).sum() == sum(sum(s.loss_mask) for s in samples)
    torch.testing.assert_close(shared_logprobs, plain_logprobs, rtol=0, atol=1e-5)
    assert plain.keys() == shared.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(shared[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["gemma", "gpt-oss"])
def test_models_with_sliding_window_layers_keep_the_plain_forward(family):
    assert not supports_continuous_batching(FAMILIES[family].loaded().model, has_processor=False)
    assert not TorchBackend(copy.deepcopy(FAMILIES[family].loaded()))._shares_prefixes


def test_media_models_activation_checkpointing_and_share_prefixes_false_keep_the_plain_forward():
    assert not TorchBackend(load_model("tiny-vl"))._shares_prefixes
    assert not TorchBackend(load_model("tiny"), gradient_checkpointing=True)._shares_prefixes
    assert not TorchBackend(load_model("tiny"), share_prefixes=False)._shares_prefixes
    assert TorchBackend(load_model("tiny"))._shares_prefixes


def test_old_logprobs_a_step_takes_itself_are_the_trained_tokens_logprobs():
    loaded = FAMILIES["llama3"].loaded()
    backend = TorchBackend(copy.deepcopy(loaded), micro_batch_tokens=1 << 20)
    samples = _samples(loaded.model.config.vocab_size)
    before = backend.logprobs(samples, temperature=0.8)  # every position, the plain forward, no sharing
    metrics = backend.train_step(samples, _pg_loss, temperature=0.8, recompute_old_logprobs=True)
    assert metrics["old_logprobs_s"] > 0
    for sample, reference in zip(samples, before, strict=True):
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        assert sample.old_logprobs is not None
        # only the trained tokens' (the loss reads them under the mask); elsewhere they may be 0
        torch.testing.assert_close(sample.old_logprobs[mask], reference.logprobs[mask], rtol=0, atol=1e-5)
