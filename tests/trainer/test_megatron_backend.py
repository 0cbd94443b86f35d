"""Megatron backend against plain PyTorch on the tiny models: TP=1 in-process, TP=2 / DP=2 / PP=2 under torchrun.

The checks themselves live in `support.megatron_scripts.common.run_checks`, so the
in-process run and the `torch.distributed.run` runs measure the same things;
here they are asserted. Skipped where the `megatron` extra is not installed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra", exc_type=ImportError)
pytest.importorskip("mbridge", reason="needs the megatron extra", exc_type=ImportError)

from support.megatron_scripts.common import (
    GRAD_CLIP,
    LR,
    MEGATRON_WARNINGS,
    MICRO_BATCH_TOKENS,
    TEMPERATURE,
    WEIGHT_DECAY,
    hf_token_logprobs,
    loss_fn,
    make_samples,
    run_checks,
)
from transformers import Qwen2Config, Qwen2ForCausalLM

from relax_gym.models import load_model, save_model
from relax_gym.trainer.backends.base import TrainBackend
from relax_gym.trainer.backends.megatron import MegatronBackend

pytestmark = [pytest.mark.filterwarnings(f) for f in MEGATRON_WARNINGS]

LOGPROB_TOL = 1e-4  # fp32; measured ≤ 2.4e-6
LOSS_TOL = 1e-5  # measured ≤ 2e-7
#: weights with a non-negligible gradient (see common.ACTIVE_GRAD); measured ≤ 1.8e-6
ACTIVE_WEIGHT_TOL = 1e-5
#: any weight: Adam's first step moves each by ≤ lr, and where |g| ~ eps by an amount sensitive to rounding
#: in g; measured ≤ 1.3e-4 = 0.013 lr
ANY_WEIGHT_TOL = 0.1 * LR
#: torchrun layouts (name → script arguments); each is one 2-process run, ~20 s on 2 CPU cores
LAYOUTS = {"tp2": ["--tp", "2", "--logprob-chunk-rows", "5"], "dp2": [], "pp2": ["--pp", "2"],
           "ep2": ["--model", "tiny-moe", "--ep", "2"]}
RUN_TIMEOUT_S = 300


def _backend(hf_model: Any, **kwargs: Any) -> MegatronBackend:
    return MegatronBackend(hf_model, lr=LR, weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP,
                           micro_batch_tokens=MICRO_BATCH_TOKENS, seed=0, **kwargs)


@pytest.fixture(scope="module")
def tp1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    hf_model = load_model("tiny").model.eval()
    return run_checks(lambda: _backend(hf_model), hf_model, tmp_path_factory.mktemp("tp1"))


@pytest.fixture(scope="module")
def parallel(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """All torchrun layouts, launched together (they overlap where there are cores to spare)."""
    root = tmp_path_factory.mktemp("torchrun")
    procs = {}
    tests = Path(__file__).resolve().parents[1]  # run from tests/, where `support` imports
    for name, args in LAYOUTS.items():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "support.megatron_scripts.parallel_check", *args,
               "--out", str(root / f"{name}.json"), "--workdir", str(root / name)]
        procs[name] = subprocess.Popen(cmd, cwd=tests, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True)
    results, failures = {}, []
    for name, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            failures.append(f"{name}: timed out after {RUN_TIMEOUT_S} s\n{output[-3000:]}")
            continue
        if proc.returncode != 0:
            failures.append(f"{name}: exit {proc.returncode}\n{output[-3000:]}")
            continue
        results[name] = json.loads((root / f"{name}.json").read_text())
    if failures:
        pytest.fail("\n\n".join(failures))
    return results


def _assert_logprobs_equal_hf(backend: MegatronBackend, hf_model: Any) -> None:
    samples = make_samples()
    got = backend.logprobs(samples, temperature=TEMPERATURE)
    with torch.no_grad():
        for s, out in zip(samples, got, strict=True):
            expected = hf_token_logprobs(hf_model, s.token_ids, TEMPERATURE)[0]
            assert (out.logprobs - expected).abs().max() <= LOGPROB_TOL


def _assert_matches_reference(r: dict[str, Any]) -> None:
    assert r["logprob_diff"] <= LOGPROB_TOL
    assert r["entropy_diff"] <= LOGPROB_TOL
    assert r["one_sample_logprob_diff"] <= LOGPROB_TOL
    assert abs(r["metrics"]["loss"] - r["ref_loss"]) <= LOSS_TOL
    assert r["exported_keys_match"]
    assert r["weight_diff_active"] <= ACTIVE_WEIGHT_TOL
    assert r["weight_diff_all"] <= ANY_WEIGHT_TOL
    assert r["export_logprob_diff"] <= LOGPROB_TOL
    assert r["resumed_extra"] == {"next_task": 7} and r["resumed_version"] == 1
    assert r["resumed_next_loss"] == r["next_loss"]
    assert r["checkpoint_hf_keys_match"] and r["checkpoint_hf_diff"] == 0.0


# --- TP=1, in-process -----------------------------------------------------------------------

@pytest.mark.slow
def test_logprobs_equal_hf(tp1: dict[str, Any]) -> None:
    assert tp1["logprob_diff"] <= LOGPROB_TOL
    assert tp1["entropy_diff"] <= LOGPROB_TOL


@pytest.mark.slow
def test_train_step_matches_torch_reference(tp1: dict[str, Any]) -> None:
    m = tp1["metrics"]
    assert abs(m["loss"] - tp1["ref_loss"]) <= LOSS_TOL
    assert m["tokens"] == m["masked_tokens"] == sum(sum(s.loss_mask) for s in make_samples())
    assert m["sequences"] == 6 and m["micro_batches"] > 1 and m["skipped"] == 0 and m["lr"] == LR
    assert tp1["weight_diff_active"] <= ACTIVE_WEIGHT_TOL
    assert tp1["weight_diff_all"] <= ANY_WEIGHT_TOL


@pytest.mark.slow
def test_export_loads_into_hf_and_gives_the_same_logprobs(tp1: dict[str, Any]) -> None:
    assert tp1["exported_keys_match"]
    assert tp1["export_logprob_diff"] <= LOGPROB_TOL


@pytest.mark.slow
def test_checkpoint_is_an_hf_model_folder_holding_the_exported_weights(tp1: dict[str, Any]) -> None:
    assert tp1["checkpoint_hf_keys_match"]
    assert tp1["checkpoint_hf_diff"] == 0.0


@pytest.mark.slow
def test_checkpoint_resume_gives_the_same_next_step(tp1: dict[str, Any]) -> None:
    assert tp1["resumed_extra"] == {"next_task": 7}
    assert tp1["resumed_version"] == 1
    assert tp1["resumed_next_loss"] == tp1["next_loss"]


@pytest.fixture(scope="module")
def moe1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    hf_model = load_model("tiny-moe").model.eval()
    return run_checks(lambda: _backend(hf_model), hf_model, tmp_path_factory.mktemp("moe1"))


@pytest.mark.slow
def test_moe_model_matches_the_torch_reference(moe1: dict[str, Any]) -> None:
    """Qwen3-MoE (experts as megatron's SequentialMLP, fused HF expert tensors sliced and stacked): logprobs,
    a step, export, checkpoint and resume as the dense model's."""
    _assert_matches_reference(moe1)


@pytest.mark.slow
def test_moe_replays_routes_as_the_torch_backend_does() -> None:
    """Routes that are not the model's own (each shifted to the next expert; the last token of each sample
    unrecorded, -1): megatron's replay and the torch backend's give the same logprobs and the same loss."""
    from relax_gym.models.moe_routing import recording
    from relax_gym.trainer.backends.torch_backend import TorchBackend

    loaded = load_model("tiny-moe")
    experts = loaded.model.config.num_experts
    samples = make_samples(vocab=loaded.model.config.vocab_size)
    for sample in samples:
        with recording(loaded.model) as taken, torch.no_grad():
            loaded.model(torch.tensor([sample.token_ids]))
        own = torch.stack([layer[0] for layer in taken], dim=1)  # [tokens, layers, top_k]
        shifted = (own + 1) % experts
        shifted[-1] = -1
        sample.routed_experts = shifted.numpy()
    megatron = _backend(loaded.model, replay_routes=True)
    torch_backend = TorchBackend(load_model("tiny-moe"), replay_routes=True, lr=LR, weight_decay=WEIGHT_DECAY)
    replayed = megatron.logprobs(samples, temperature=TEMPERATURE)
    expected = torch_backend.logprobs(samples, temperature=TEMPERATURE)
    assert max((a.logprobs - b.logprobs).abs().max().item() for a, b in zip(replayed, expected, strict=True)) \
        <= LOGPROB_TOL
    own_routes = [replace(s, routed_experts=None) for s in samples]
    free = megatron.logprobs(own_routes, temperature=TEMPERATURE)  # the routers' own choice again after a replay
    assert max((a.logprobs - b.logprobs).abs().max().item() for a, b in zip(free, replayed, strict=True)) > 1e-3
    loss = megatron.train_step(samples, loss_fn, temperature=TEMPERATURE)["loss"]
    assert abs(loss - torch_backend.train_step(samples, loss_fn, temperature=TEMPERATURE)["loss"]) <= LOSS_TOL


@pytest.mark.slow
def test_qwen2_logprobs_equal_hf(tp1: dict[str, Any]) -> None:
    """Qwen2 goes through the same fixed bridge (QKV bias, no q/k norm)."""
    config = Qwen2Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf_model = Qwen2ForCausalLM(config).eval()
        for layer in hf_model.model.layers:  # HF initialises biases at 0; random ones test their layout
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    _assert_logprobs_equal_hf(_backend(hf_model), hf_model)


@pytest.mark.slow
def test_loads_from_hf_folder(tmp_path: Path) -> None:
    """A checkpoint folder is read through mbridge's safetensors reader (only TP rank 0 reads)."""
    loaded = load_model("tiny")
    save_model(loaded, tmp_path / "hf")
    _assert_logprobs_equal_hf(_backend(str(tmp_path / "hf")), loaded.model)


def test_protocol_and_bad_input() -> None:
    backend = _backend(load_model("tiny").model)
    assert isinstance(backend, TrainBackend)
    with pytest.raises(ValueError, match="no samples"):
        backend.train_step([], loss_fn)
    bad = make_samples()[:1]
    bad[0].loss_mask = bad[0].loss_mask[:-1]
    with pytest.raises(ValueError, match="per-token fields"):
        backend.logprobs(bad)
    with pytest.raises(ValueError, match="world size 1"):
        _backend(load_model("tiny").model, tp=2)


def test_chunked_vocab_parallel_logprobs_equal_autograd_through_log_softmax() -> None:
    """At TP=1, a chunk of 3 rows at a time: the same logprobs, entropy and gradients as plain autograd through
    `log_softmax`, with a masked (-inf) vocabulary entry (-1e4 in the reference, where autograd would make
    0 * -inf) and a temperature (TP=2 runs in the `tp2` layout)."""
    from relax_gym.trainer.backends.megatron.vocab_logprobs import vocab_parallel_token_logprobs

    def reference(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, *, with_entropy: bool):
        logp = (logits.nan_to_num(neginf=-1e4) / temperature).log_softmax(-1)
        picked = logp[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
        return torch.nn.functional.pad(picked, (1, 0)), torch.nn.functional.pad(entropy, (1, 0))

    _backend(load_model("tiny").model)  # megatron's parallel state, TP=1
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 50, generator=generator, dtype=torch.float64) * 3
    logits[0, 2, 5] = -torch.inf
    input_ids = torch.randint(0, 50, (2, 7), generator=generator)
    weights = torch.randn(2, 2, 7, generator=generator, dtype=torch.float64)
    results = []
    for fn in (partial(vocab_parallel_token_logprobs, chunk_rows=3), reference):
        leaf = logits.clone().requires_grad_()
        logprobs, entropy = fn(leaf, input_ids, 0.7, with_entropy=True)
        ((logprobs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
        results.append((logprobs.detach(), entropy.detach(), leaf.grad))
    for ours, expected in zip(*results, strict=True):
        assert torch.allclose(ours, expected, atol=1e-10), (ours - expected).abs().max()


def test_sdpa_core_attention_equals_megatrons_dot_product_attention() -> None:
    """The same outputs and input gradients as the local spec's `DotProductAttention`: causal, grouped-query
    heads (4 heads over 2 groups), with and without an explicit padding mask."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from relax_gym.trainer.backends.megatron import compat
    from relax_gym.trainer.backends.megatron.sdpa_attention import SDPAttention

    _backend(load_model("tiny").model)  # megatron's parallel state, TP=1
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               kv_channels=16, attention_dropout=0.0, masked_softmax_fusion=False)
    generator = torch.Generator().manual_seed(0)
    s, b = 9, 2
    inputs = [torch.randn(s, b, heads, 16, generator=generator) for heads in (4, 2, 2)]
    padding = torch.zeros(b, 1, s, s, dtype=torch.bool)
    padding[1, ..., -3:] = True  # the second row's last 3 keys are padding
    for mask in (None, padding):
        outs = []
        for cls in (SDPAttention, DotProductAttention):
            attention = cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
            leaves = [t.clone().requires_grad_() for t in inputs]
            causal = torch.ones(s, s, dtype=torch.bool).triu(1)
            with compat.cuda_on_cpu():  # megatron's score buffer is made on the CUDA device
                out = attention(*leaves, mask if cls is SDPAttention or mask is None else mask | causal)
            out.square().sum().backward()
            outs.append([out.detach(), *(leaf.grad for leaf in leaves)])
        for ours, theirs in zip(*outs, strict=True):
            assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


# --- bf16 ----------------------------------------------------------------------------------------

BF16_LOGPROB_TOL = 0.02  # bf16 weights and activations; measured 0.004 on the tiny model
BF16_LOSS_TOL = 2e-3  # measured 3e-4


@pytest.mark.slow
def test_bf16_trains_as_fp32_does_and_resumes_exactly_from_its_float32_main_params(tmp_path: Path) -> None:
    """bf16 parameters (GPU's default, forced here on the CPU) with megatron's float32 main parameters: the same
    logprobs and loss as fp32 within bf16's precision; a checkpoint restores the main parameters themselves, so
    the resumed run takes the very steps the original takes (rebuilding them from the bf16 weights would not)."""
    hf_model = load_model("tiny").model.eval()
    samples = make_samples(vocab=hf_model.config.vocab_size)
    step = partial(MegatronBackend.train_step, samples=samples, loss_fn=loss_fn, temperature=TEMPERATURE)
    bf16, fp32 = _backend(hf_model, dtype="bfloat16"), _backend(hf_model, dtype="float32")
    assert next(bf16.models[0].parameters()).dtype == torch.bfloat16 and bf16._main_params()
    assert not fp32._main_params()  # fp32: the model's parameters are the main ones
    got, ref = (b.logprobs(samples, temperature=TEMPERATURE) for b in (bf16, fp32))
    assert max((g.logprobs - r.logprobs).abs().max().item() for g, r in zip(got, ref, strict=True)) <= BF16_LOGPROB_TOL
    assert abs(step(bf16)["loss"] - step(fp32)["loss"]) <= BF16_LOSS_TOL

    bf16.save_checkpoint(tmp_path / "ck", {"next_task": 3})
    expected = [step(bf16)["loss"] for _ in range(2)]
    resumed = _backend(hf_model, dtype="bfloat16")
    assert resumed.load_checkpoint(tmp_path / "ck") == {"next_task": 3}
    assert [step(resumed)["loss"] for _ in range(2)] == expected
    after, resumed_after = bf16.hf_state_dict(), resumed.hf_state_dict()
    assert all(torch.equal(after[k], resumed_after[k]) for k in after)

    rebuilt = _backend(hf_model, dtype="bfloat16")
    rebuilt.load_checkpoint(tmp_path / "ck")
    rebuilt.optimizer.reload_model_params()  # main params from the bf16 weights, as without them in the checkpoint
    rebuilt_after = [step(rebuilt) for _ in range(2)] and rebuilt.hf_state_dict()
    assert not all(torch.equal(after[k], rebuilt_after[k]) for k in after)
    with pytest.raises(ValueError, match=r"float32 main parameters, this backend \(float32\) has 0"):
        fp32.load_checkpoint(tmp_path / "ck")


# --- TP=2, DP=2, PP=2, EP=2 under torch.distributed.run ----------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layout_matches_reference(parallel: dict[str, dict[str, Any]], layout: str) -> None:
    _assert_matches_reference(parallel[layout])
    sizes = parallel[layout]["export_sizes"]  # one CPU copy of the model in the job: rank 0's
    assert sizes[0] > 0 and sizes[1:] == [0] * (len(sizes) - 1)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_step_loss_equals_one_rank(parallel: dict[str, dict[str, Any]], request: pytest.FixtureRequest,
                                            layout: str) -> None:
    """Each layout's losses are one rank's with the same model (tp1, or moe1 for expert parallelism)."""
    one = request.getfixturevalue("moe1" if parallel[layout]["ep"] > 1 else "tp1")
    assert abs(parallel[layout]["metrics"]["loss"] - one["metrics"]["loss"]) <= LOSS_TOL
    assert abs(parallel[layout]["next_loss"] - one["next_loss"]) <= LOSS_TOL
    assert abs(parallel[layout]["one_sample_step_loss"] - one["one_sample_step_loss"]) <= LOSS_TOL


def test_one_step_gives_the_same_loss_on_both_backends() -> None:
    """The same samples and the real GRPO loss on TorchBackend and MegatronBackend: same losses.

    Two steps, so the second loss also shows the two optimizers updated the weights alike.
    """
    from relax_gym.trainer.algorithms import AlgorithmConfig, make_loss_fn
    from relax_gym.trainer.backends.torch_backend import TorchBackend

    samples = make_samples()
    for i, s in enumerate(samples):
        s.advantage = (-1.0) ** i * (0.5 + i / 10)
    grpo = make_loss_fn(AlgorithmConfig(algorithm="grpo", entropy_coef=0.01))
    kwargs = {"lr": 1e-3, "weight_decay": 0.0, "grad_clip": 1.0, "micro_batch_tokens": MICRO_BATCH_TOKENS, "seed": 0}
    backends = {"torch": TorchBackend(load_model("tiny"), **kwargs),
                "megatron": MegatronBackend(load_model("tiny").model, **kwargs)}
    losses = {name: [b.train_step(samples, grpo, temperature=0.8)["loss"] for _ in range(2)]
              for name, b in backends.items()}
    assert losses["torch"][0] == pytest.approx(losses["megatron"][0], abs=1e-5)
    assert losses["torch"][1] == pytest.approx(losses["megatron"][1], abs=1e-4)
    assert losses["torch"][1] != losses["torch"][0]  # the first step changed the weights
