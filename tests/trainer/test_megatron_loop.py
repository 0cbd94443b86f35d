"""The train loop with the Megatron backend: in one process, and under torchrun with TP=2 (rank 0 drives)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax_gym.cli import main
from relax_gym.models import load_model

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
WARM_START = ROOT / "examples" / "checkpoints" / "tiny-arithmetic"
QUICKSTART = ROOT / "examples" / "configs" / "quickstart.yaml"


def overrides(run_dir: Path, *extra: str) -> list[str]:
    return [f"run_dir={run_dir}", f"model={WARM_START}",
            "trainer.backend=megatron", "trainer.total_steps=2", "trainer.checkpoint_every=2",
            "trainer.eval_every=0", "rollout.groups_per_step=4", "trainer.lr=3e-4", *extra]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_megatron_backend_trains_through_the_async_loop(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "relax_gym.cli", "train", str(QUICKSTART), *overrides(run)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = records(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/grad_norm"] > 0 for r in rows)
    assert (run / "checkpoints" / "step_2" / "meta.pt").is_file()

    # the step folder is a model folder too: it exports (no Megatron shards) and loads in plain transformers
    exported = tmp_path / "exported"
    assert main(["export", str(run), "-o", str(exported)]) == 0
    assert {p.name for p in exported.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    warm = load_model(str(WARM_START))
    assert tokenizer.chat_template == warm.tokenizer.chat_template
    assert model.generation_config.eos_token_id == warm.model.generation_config.eos_token_id
    trained, initial = model.state_dict(), warm.model.state_dict()
    assert trained.keys() == initial.keys() and any(not torch.equal(trained[k], initial[k]) for k in initial)
    loaded = load_model(str(run / "checkpoints" / "latest"))
    assert all(torch.equal(v, trained[k]) for k, v in loaded.model.state_dict().items())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_megatron_tp2_under_torchrun_rank0_drives_and_rank1_follows(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "relax_gym.cli",
           "train", str(QUICKSTART), *overrides(run, "trainer.megatron.tp=2")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = records(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/grad_norm"] > 0 for r in rows)
    checkpoint = run / "checkpoints" / "step_2"
    assert {p.name for p in checkpoint.iterdir()} >= {"model_tp0_pp0.pt", "model_tp1_pp0.pt", "meta.pt",
                                                     "config.json", "model.safetensors", "tokenizer.json"}
    # the TP shards, gathered by both ranks and written by rank 0, make the whole model
    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    initial = load_model(str(WARM_START)).model.state_dict()
    assert model.state_dict().keys() == initial.keys()


@pytest.mark.slow
def test_megatron_trains_an_moe_policy_with_routing_replay(tmp_path):
    """examples/configs/moe_r3.yaml on the Megatron backend: the engine's routes reach megatron's routers."""
    run = tmp_path / "run"
    args = [f"run_dir={run}", "trainer.backend=megatron", "trainer.total_steps=2", "trainer.checkpoint_every=2",
            "trainer.eval_every=0", "rollout.groups_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
            "algorithm.entropy_coef=0.01", "trainer.lr=1e-3"]  # random weights earn no reward: the bonus trains
    out = subprocess.run([sys.executable, "-m", "relax_gym.cli", "train", str(ROOT / "examples" / "configs" /
                          "moe_r3.yaml"), *args], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = records(run)
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/grad_norm"] > 0 for r in rows)
    trained = load_model(str(run / "checkpoints" / "latest")).model.state_dict()
    initial = load_model("tiny-moe").model.state_dict()
    assert not torch.equal(trained["model.layers.0.mlp.experts.gate_up_proj"],
                           initial["model.layers.0.mlp.experts.gate_up_proj"])
