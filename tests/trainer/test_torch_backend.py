"""The PyTorch training backend on the real tiny models: logprobs, micro-batching, gradients, checkpoints."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from relax_gym import messages as M
from relax_gym.models import MEDIA_KEYS, TINY_MODELS, load_model, processor_inputs, render_ids
from relax_gym.trainer.backends import (
    MicroBatch,
    Sample,
    TorchBackend,
    TrainBackend,
    pack_micro_batches,
    token_logprobs,
)
from relax_gym.trainer.backends.torch_backend import trained_columns

MULTIMODAL = ("tiny-vl", "tiny-audio")


def _pg_loss(mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean policy gradient: normalised by the step's trained tokens, so micro-batching cannot change it."""
    return -(mb.logprobs * mb.advantages * mb.mask).sum() / mb.step_tokens, {"micro_batch_count": 1.0}


def _media(name: str, rng: np.random.Generator) -> list[M.Part]:
    """One image or clip of a random size (none for the text model), so samples differ in media shape."""
    if name == "tiny-vl":
        height, width = (int(x) for x in rng.integers(32, 96, 2))
        return [M.image(Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)))]
    if name == "tiny-audio":
        return [M.audio(rng.standard_normal(int(rng.integers(6_000, 20_000))).astype(np.float32) * 0.1, 16_000)]
    return []


def _example(name: str, loaded, seed: int, *, media: bool = True) -> tuple[Sample, dict[str, torch.Tensor]]:
    """A two-turn episode with media in both user turns, as a Sample, plus the processor's own inputs for it.

    The tokens are one processor render of the whole conversation, so the
    processor's inputs are an independent reference for the backend's. Tokens
    after the first prompt are trained at random (about 70%).
    """
    rng = np.random.default_rng(seed)
    if not media:
        name = "tiny"  # no media parts, whatever the model
    conversation = [
        M.user(f"Question {seed}?", *_media(name, rng)),
        M.assistant(f"First answer {seed}" + " ab" * (1 + 2 * seed)),
        M.user("And this one?", *_media(name, rng)),
        M.assistant(f"Second answer {seed}" + " cd" * int(rng.integers(1, 4))),
    ]
    inputs = processor_inputs(loaded, conversation, add_generation_prompt=False)
    ids = inputs["input_ids"][0].tolist()
    prompt = len(render_ids(loaded, conversation[:1]))
    mask = [0] * prompt + (rng.random(len(ids) - prompt) < 0.7).astype(int).tolist()
    sample = Sample(
        token_ids=ids,
        loss_mask=mask,
        rollout_logprobs=[0.0] * len(ids),
        advantage=float(rng.choice([-1.0, 1.0])),
        mm_inputs={k: inputs[k] for k in MEDIA_KEYS if k in inputs},
    )
    return sample, dict(inputs)


def _samples(name: str, n: int, loaded=None) -> list[Sample]:
    loaded = loaded or load_model(name)
    return [_example(name, loaded, seed)[0] for seed in range(n)]


def _reference(model, inputs: dict[str, torch.Tensor], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs and entropy straight from an HF forward with full softmax, aligned as the contract says."""
    with torch.no_grad():
        logits = model(**inputs).logits[0].double() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    ids = inputs["input_ids"][0]
    logprobs = torch.cat([torch.zeros(1, dtype=logp.dtype), logp[:-1].gather(-1, ids[1:, None]).squeeze(-1)])
    entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, torch.cat([torch.zeros(1, dtype=logp.dtype), entropy[:-1]])


def _train_capturing_grads(
    backend: TorchBackend, samples: list[Sample]
) -> tuple[dict[str, float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One step; returns its metrics, the (clipped) gradients the optimizer saw, and the updated weights."""
    grads: dict[str, torch.Tensor] = {}
    named = [(n, p) for n, p in backend.model.named_parameters() if p.requires_grad]

    def capture(*_: object) -> None:
        grads.update({n: p.grad.clone() for n, p in named if p.grad is not None})

    handle = backend.optimizer.register_step_pre_hook(capture)
    metrics = backend.train_step(samples, _pg_loss)
    handle.remove()
    return metrics, grads, {n: p.detach().clone() for n, p in named}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# --- logprobs --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_logprobs_and_entropy_equal_a_direct_hf_forward(name, temperature):
    """Three samples of different lengths (and image sizes / clip lengths) and a text-only one in one
    padded micro-batch give what the processor's own inputs give through the model one at a time."""
    loaded = load_model(name)
    examples = [_example(name, loaded, seed) for seed in range(3)]
    examples.insert(1, _example(name, loaded, 3, media=False))
    backend = TorchBackend(loaded, micro_batch_tokens=10**6)
    outputs = backend.logprobs([s for s, _ in examples], temperature=temperature, with_entropy=True)
    assert len({len(s.token_ids) for s, _ in examples}) > 1  # padding is exercised
    for (sample, inputs), out in zip(examples, outputs, strict=True):
        logprobs, entropy = _reference(loaded.model, inputs, temperature)
        assert out.logprobs.shape == out.entropy.shape == (len(sample.token_ids),)
        assert out.logprobs.dtype == torch.float32
        assert out.logprobs[0] == 0 and out.entropy[0] == 0
        assert torch.allclose(out.logprobs.double(), logprobs, atol=1e-5, rtol=0)
        assert torch.allclose(out.entropy.double(), entropy, atol=1e-5, rtol=0)


def test_entropy_equals_the_hand_computation_on_a_short_sequence():
    loaded = load_model("tiny")
    ids = [5, 17, 300, 42, 9]
    sample = Sample(ids, [0, 1, 1, 1, 1], [0.0] * 5)
    out = TorchBackend(loaded).logprobs([sample], temperature=0.7, with_entropy=True)[0]
    with torch.no_grad():
        probs = torch.softmax(loaded.model(torch.tensor([ids])).logits[0].double() / 0.7, dim=-1)
    by_hand = [0.0] + [-sum(p * np.log(p) for p in probs[t].tolist()) for t in range(4)]
    assert np.allclose(out.entropy.tolist(), by_hand, atol=1e-5, rtol=0)


def test_token_logprobs_gradient_and_chunking():
    """The hand-written backward (softmax recomputed per chunk) against finite differences, in fp64,
    chunked across sequence and batch boundaries; and -inf logits (masked vocabulary) stay finite."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, generator=generator, requires_grad=True)
    ids = torch.randint(0, 7, (2, 5), generator=generator)

    def both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(x, ids, 0.7, with_entropy=True, chunk_rows=3)

    assert torch.autograd.gradcheck(both, (logits,))
    logprobs, entropy = both(logits)
    whole = token_logprobs(logits, ids, 0.7, with_entropy=True)
    assert torch.allclose(logprobs, whole[0]) and torch.allclose(entropy, whole[1])

    # Memory: the only [N, V]-sized tensor autograd keeps for backward is the logits themselves.
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_logprobs(logits * 1.0, ids, 0.7, with_entropy=True, chunk_rows=3)
    assert [t.shape for t in saved if t.numel() >= logits.numel()] == [(10, 7)]

    masked = logits.detach().clone()
    masked[..., -1] = -torch.inf
    ids = ids.clamp(max=5)
    logprobs, entropy = token_logprobs(masked.requires_grad_(), ids, with_entropy=True, chunk_rows=4)
    (logprobs.sum() + 3 * entropy.sum()).backward()  # an entropy weight over 1 once made 0 * -inf = NaN
    assert torch.isfinite(logprobs).all() and torch.isfinite(entropy).all() and torch.isfinite(masked.grad).all()
    assert (masked.grad[..., -1] == 0).all()
    far = masked.detach().clone().nan_to_num(neginf=-1e4).requires_grad_()  # p = 0 there too, in fp64
    logprobs, entropy = token_logprobs(far, ids, with_entropy=True, chunk_rows=4)
    (logprobs.sum() + 3 * entropy.sum()).backward()
    assert torch.allclose(masked.grad, far.grad)


def test_pack_micro_batches_is_greedy_in_order():
    assert pack_micro_batches([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]
    # padded size counts: [2, 4] pads to 2 x 4 = 8
    assert pack_micro_batches([2, 4, 1, 1], 8) == [[0, 1], [2, 3]]
    assert pack_micro_batches([2, 4, 1], 7) == [[0], [1], [2]]
    assert pack_micro_batches([10, 2, 2], 4) == [[0], [1, 2]]  # too long alone, still trained
    assert pack_micro_batches([5, 5], 1) == [[0], [1]]


# --- training --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY_MODELS)
def test_micro_batching_changes_neither_loss_nor_gradients_nor_weights(name):
    """Five samples (with media for VL / audio, concatenated across the micro-batch) as five
    micro-batches or as one padded micro-batch. At the default lr: Adam's first step is about
    lr * g / (|g| + eps), which turns fp32 summation-order noise in gradients near eps into
    weight differences of order lr, so a large lr would test Adam rather than the backend."""
    samples = _samples(name, 5)
    runs = {}
    for budget in (1, 10**6):
        backend = TorchBackend(load_model(name), micro_batch_tokens=budget)
        runs[budget] = _train_capturing_grads(backend, samples)
    (small, small_grads, small_weights), (big, big_grads, big_weights) = runs[1], runs[10**6]
    assert small["micro_batches"] == small["micro_batch_count"] == 5
    assert big["micro_batches"] == big["micro_batch_count"] == 1
    assert small["tokens"] == big["tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert abs(small["loss"] - big["loss"]) <= 1e-6
    assert abs(small["grad_norm"] - big["grad_norm"]) <= 1e-6 * big["grad_norm"]
    assert _max_diff(small_grads, big_grads) <= 1e-6
    assert _max_diff(small_weights, big_weights) <= 1e-6


@pytest.mark.parametrize(("name", "tower"), [("tiny-vl", "model.visual."), ("tiny-audio", "model.audio_tower."),
                                             ("tiny-moe", "model.layers.0.mlp.gate.")])
def test_trained_tokens_reach_the_media_tower_and_the_language_model(name, tower):
    """Every trainable parameter moves: the media towers, and for the MoE model its routers (through the top-k
    weights) and its experts."""
    loaded = load_model(name)
    sample = _samples(name, 1, loaded)[0]
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if p.requires_grad}
    assert any(n.startswith(tower) for n in before)
    TorchBackend(loaded, lr=1e-3).train_step([sample], _pg_loss)
    after = dict(loaded.model.named_parameters())
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert unchanged == []


def test_masked_tokens_do_not_affect_the_loss():
    """Masked junk appended after the last trained token changes those positions' logprobs (and the
    padding layout) but neither the loss nor any gradient; moving a trained token does change them."""
    name = "tiny"
    samples = _samples(name, 3)
    rng = np.random.default_rng(1)
    with_junk = [
        Sample(
            s.token_ids + rng.integers(0, 900, 7).tolist(),
            [*s.loss_mask, *[0] * 7],
            [0.0] * (len(s.token_ids) + 7),
            advantage=s.advantage,
        )
        for s in samples
    ]
    moved_mask = list(samples[0].loss_mask)
    first, last = moved_mask.index(1), len(moved_mask) - 1 - moved_mask[::-1].index(0)
    moved_mask[first], moved_mask[last] = 0, 1
    moved = [Sample(samples[0].token_ids, moved_mask, samples[0].rollout_logprobs, samples[0].advantage), *samples[1:]]

    runs = [_train_capturing_grads(TorchBackend(load_model(name)), batch) for batch in (samples, with_junk, moved)]
    (base, base_grads, _), (junk, junk_grads, _), (other, other_grads, _) = runs
    assert abs(base["loss"] - junk["loss"]) <= 1e-6
    assert _max_diff(base_grads, junk_grads) <= 1e-6
    assert abs(base["loss"] - other["loss"]) > 1e-4
    assert _max_diff(base_grads, other_grads) > 1e-4


def test_train_step_metrics_version_and_optional_fields():
    samples = _samples("tiny", 3)
    old = TorchBackend(load_model("tiny")).logprobs(samples)
    for s, o in zip(samples, old, strict=True):
        s.old_logprobs = o.logprobs
    seen: list[MicroBatch] = []

    def loss_fn(mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        seen.append(mb)
        ratio = torch.exp(mb.logprobs - mb.old_logprobs)
        loss = -(ratio * mb.advantages * mb.mask).sum() / mb.step_tokens
        return loss, {"ratio_sum": float((ratio * mb.mask).sum().detach())}

    backend = TorchBackend(load_model("tiny"), micro_batch_tokens=2 * max(len(s.token_ids) for s in samples))
    assert isinstance(backend, TrainBackend) and backend.version == 0
    metrics = backend.train_step(samples, loss_fn)
    assert backend.version == 1
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["micro_batches"] == len(seen) == 2 and metrics["skipped"] == 0.0
    assert metrics["lr"] == 1e-5 and metrics["grad_norm"] > 0
    assert metrics["tokens"] == seen[0].step_tokens == sum(sum(s.loss_mask) for s in samples)
    assert metrics["sequences"] == seen[0].step_sequences == 3
    # on-policy: every trained ratio is 1, and the loss_fn's metrics are summed over micro-batches
    assert abs(metrics["ratio_sum"] - metrics["tokens"]) < 1e-3
    mb = seen[0]
    assert mb.logprobs.requires_grad and mb.entropy is not None and mb.ref_logprobs is None
    assert mb.mask.shape == mb.advantages.shape == mb.rollout_logprobs.shape == mb.logprobs.shape
    short = min(range(len(mb.mask)), key=lambda i: int((mb.logprobs[i] != 0).sum()))
    assert mb.logprobs[short, -1] == 0 and mb.mask[short, -1] == 0 and mb.advantages[short, -1] == 0
    backend.train_step(samples, loss_fn)
    assert backend.version == 2


def test_a_step_with_no_trained_tokens_is_skipped_not_applied():
    samples = _samples("tiny", 2)
    for s in samples:
        s.loss_mask = [0] * len(s.token_ids)
    backend = TorchBackend(load_model("tiny"))
    before = backend.hf_state_dict()
    metrics = backend.train_step(samples, _pg_loss)  # 0 / 0: non-finite gradients
    assert metrics["skipped"] == 1.0 and backend.version == 1
    assert all(torch.equal(before[k], v) for k, v in backend.hf_state_dict().items())


@pytest.mark.parametrize("name", ["tiny", "tiny-vl"])
def test_projecting_only_trained_positions_gives_the_full_forwards_step(name):
    """The step's forward keeps only the trained positions' logits (`logits_to_keep`): the loss, the gradients
    and the entropy metric are those of the forward over every position."""
    samples = _samples(name, 3)
    full = TorchBackend(load_model(name))
    full._keeps_logits = False
    kept = TorchBackend(load_model(name))
    assert kept._keeps_logits
    (full_metrics, full_grads, _), (kept_metrics, kept_grads, _) = (
        _train_capturing_grads(b, samples) for b in (full, kept)
    )
    assert abs(full_metrics["loss"] - kept_metrics["loss"]) <= 1e-6
    assert _max_diff(full_grads, kept_grads) <= 1e-6


def test_trained_columns_are_the_positions_that_predict_trained_tokens():
    assert trained_columns([[0, 0, 1, 1, 0], [0, 0, 0, 1]], 5).tolist() == [1, 2]
    assert trained_columns([[0, 0, 0]], 3).tolist() == [0]  # nothing trained: one column keeps the graph


def test_gradient_checkpointing_gives_the_same_gradients():
    samples = _samples("tiny-vl", 2)
    plain, checkpointed = (
        _train_capturing_grads(TorchBackend(load_model("tiny-vl"), gradient_checkpointing=flag), samples)
        for flag in (False, True)
    )
    assert abs(plain[0]["loss"] - checkpointed[0]["loss"]) <= 1e-6
    assert _max_diff(plain[1], checkpointed[1]) <= 1e-6


def test_the_config_turns_gradient_checkpointing_on():
    from relax_gym.trainer.config import load_config
    from relax_gym.trainer.policy import make_backend

    cfg = load_config(None, ["model=tiny", "envs=[{id: relax/Arithmetic-v0}]", "trainer.gradient_checkpointing=true"])
    assert make_backend(cfg, load_model("tiny")).model.is_activation_checkpointing


def test_bf16_autocast_keeps_fp32_master_weights():
    """The GPU default, exercised on CPU autocast: weights stay fp32, logprobs near the fp32 ones."""
    samples = _samples("tiny", 2)
    reference = TorchBackend(load_model("tiny")).logprobs(samples)
    backend = TorchBackend(load_model("tiny"), dtype=torch.bfloat16, device="cpu")
    assert backend.autocast_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in backend.model.parameters())
    for out, ref in zip(backend.logprobs(samples), reference, strict=True):
        assert out.logprobs.dtype == torch.float32
        assert torch.allclose(out.logprobs, ref.logprobs, atol=0.1)
    metrics = backend.train_step(samples, _pg_loss)
    assert metrics["skipped"] == 0.0 and np.isfinite(metrics["loss"])


def test_invalid_inputs_are_rejected():
    backend = TorchBackend(load_model("tiny"))
    good = Sample([1, 2, 3], [0, 1, 1], [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="token 0 is trained"):
        backend.logprobs([Sample([1, 2], [1, 1], [0.0, 0.0])])
    with pytest.raises(ValueError, match="must match its 3 token_ids"):
        backend.logprobs([Sample([1, 2, 3], [0, 1], [0.0, 0.0, 0.0])])
    with pytest.raises(ValueError, match="old_logprobs is set on some"):
        backend.train_step([good, Sample([1, 2], [0, 1], [0.0, 0.0], old_logprobs=torch.zeros(2))], _pg_loss)
    with pytest.raises(ValueError, match="temperature"):
        backend.logprobs([good], temperature=0.0)
    with pytest.raises(ValueError, match="no samples"):
        backend.train_step([], _pg_loss)
    with pytest.raises(ValueError, match="fp16"):
        TorchBackend(load_model("tiny"), dtype=torch.float16)


# --- weights and checkpoints -----------------------------------------------------------------


@pytest.mark.parametrize("name", TINY_MODELS)
def test_hf_state_dict_loads_into_a_fresh_model_of_the_same_class(name):
    samples = _samples(name, 2)
    backend = TorchBackend(load_model(name), lr=1e-3)
    backend.train_step(samples, _pg_loss)
    weights = backend.hf_state_dict()
    model_state = backend.model.state_dict()
    assert weights.keys() == model_state.keys()
    assert all(t.device.type == "cpu" and torch.equal(t, model_state[k]) for k, t in weights.items())
    assert all(t.data_ptr() != model_state[k].data_ptr() for k, t in weights.items())  # copies
    if name == "tiny":  # tied embeddings stay one tensor
        assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]

    engine_model = load_model(name).model
    engine_model.load_state_dict(weights)
    assert all(torch.equal(a, b) for a, b in zip(engine_model.state_dict().values(), model_state.values(), strict=True))


@pytest.mark.parametrize("name", TINY_MODELS)
def test_resumed_run_reproduces_the_next_step_exactly(name, tmp_path):
    first, second = _samples(name, 2), _samples(name, 4)[2:]
    uninterrupted = TorchBackend(load_model(name), lr=1e-3, micro_batch_tokens=64)
    uninterrupted.train_step(first, _pg_loss)
    extra = {"data_position": 7, "note": ("plain", "data")}  # tensors and plain data only: see safe_load
    uninterrupted.save_checkpoint(tmp_path / "ckpt", extra)
    rng_after_save = (torch.rand(3), np.random.rand(), random.random())
    expected = uninterrupted.train_step(second, _pg_loss)

    loaded = load_model(name)
    with torch.no_grad():  # different weights, so only the checkpoint can make the runs agree
        for p in loaded.model.parameters():
            p.add_(0.01)
    resumed = TorchBackend(loaded, lr=1e-3, micro_batch_tokens=64, seed=123)
    assert resumed.load_checkpoint(tmp_path / "ckpt") == extra
    assert resumed.version == 1
    assert torch.equal(torch.rand(3), rng_after_save[0])
    assert (np.random.rand(), random.random()) == rng_after_save[1:]
    got = resumed.train_step(second, _pg_loss)
    assert resumed.version == uninterrupted.version == 2
    assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
    theirs = uninterrupted.model.state_dict()
    assert all(torch.equal(t, theirs[k]) for k, t in resumed.model.state_dict().items())


def test_pad_rows_places_lists_and_tensors_and_refuses_a_row_wider_than_the_batch():
    from relax_gym.trainer.backends.base import pad_rows

    assert pad_rows([[1, 2], torch.tensor([3]), []], 3, dtype=torch.long).tolist() == [[1, 2, 0], [3, 0, 0], [0, 0, 0]]
    assert pad_rows([torch.tensor([0.5, 1.5])], 4).tolist() == [[0.5, 1.5, 0.0, 0.0]]
    with pytest.raises(ValueError, match="does not fit"):
        pad_rows([[1, 2, 3]], 2)
