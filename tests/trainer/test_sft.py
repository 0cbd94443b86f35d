"""`relax-gym sft`: fine-tuning on trajectory files with RL's loss masks, and what it refuses."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from relax_gym.cli import main
from relax_gym.models import load_model
from relax_gym.trainer.algorithms import sft_loss_fn
from relax_gym.trainer.batch import MicroBatch
from relax_gym.trajectory import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
WARM_START = ROOT / "examples" / "checkpoints" / "tiny-arithmetic"
SUMS = ["--env", "relax/Arithmetic-v0", "--env-arg", "digits=1", "--env-arg", "n_terms=2", "--env-arg", "ops=+",
        "--max-new-tokens", "4", "--max-turns", "1", "--max-total-tokens", "128"]


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory) -> Path:
    """The warm start's sampled answers to 48 sums, 4 each: about a fifth right."""
    out = tmp_path_factory.mktemp("sft") / "rollouts.jsonl"
    assert main(["rollout", "--model", str(WARM_START), *SUMS, "-n", "48", "--group", "4", "--temperature", "0.5",
                 "--out", str(out)]) == 0
    return out


def test_the_loss_is_the_mean_negative_log_likelihood_of_the_trained_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    zeros = torch.zeros(2, 3)
    batch = MicroBatch(logprobs=logprobs, entropy=None, mask=mask, advantages=zeros, rollout_logprobs=zeros,
                       old_logprobs=None, ref_logprobs=None, teacher_logprobs=None, step_tokens=3, step_sequences=2)
    loss, metrics = sft_loss_fn()(batch)
    assert math.isclose(float(loss.detach()), (2 + 3 + 4) / 3) and math.isclose(metrics["loss"], 3.0)
    loss.backward()
    assert torch.equal(logprobs.grad, -mask / 3)


def test_rejection_sampling_keeps_the_rewarded_episodes_and_writes_a_model_that_loads(rollouts, tmp_path, capsys):
    rewarded = sum(t.reward >= 1 for t in read_jsonl(rollouts))
    out = tmp_path / "warm"
    assert main(["sft", str(rollouts), "--model", str(WARM_START), "--out", str(out), "--min-reward", "1",
                 "--epochs", "2", "--lr", "1e-3"]) == 0
    said = capsys.readouterr().out
    assert f"sft: {rewarded} of 192 trajectories kept (left out: {{'reward below 1': {192 - rewarded}}})" in said
    rows = [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1] * (len(rows) // 2) + [2] * (len(rows) // 2)
    assert rows[-1]["loss"] < rows[0]["loss"], rows
    tuned, base = load_model(str(out)), load_model(str(WARM_START))
    assert tuned.tokenizer.chat_template == base.tokenizer.chat_template
    assert any(not torch.equal(a, b) for a, b in zip(tuned.model.state_dict().values(),
                                                     base.model.state_dict().values(), strict=True))


@pytest.mark.parametrize("case", ["nothing kept", "another tokenizer", "not trajectories", "out not empty"])
def test_sft_refuses_data_that_cannot_teach_in_one_line(case, rollouts, tmp_path, capsys):
    data, out, extra = rollouts, tmp_path / "out", []
    if case == "nothing kept":
        extra, cause = ["--min-reward", "2"], "none of the 192 trajectories"
    elif case == "another tokenizer":
        row = json.loads(rollouts.read_text().splitlines()[0])
        row["token_ids"][0] = 10**6
        data = tmp_path / "other.jsonl"
        data.write_text(json.dumps(row) + "\n")
        cause = "record 1: token id 1000000 is outside the model's vocabulary"
    elif case == "not trajectories":
        data = tmp_path / "notes.jsonl"
        data.write_text('{"hello": 1}\n')
        cause = "cannot read it as trajectories"
    else:
        out.mkdir()
        (out / "config.json").write_text("{}")
        cause = "not a new or empty folder"
    code = main(["sft", str(data), "--model", str(WARM_START), "--out", str(out), *extra])
    said = capsys.readouterr().out
    assert code == 2 and said.count("\n") == 1 and cause in said.replace("\n", ""), said


def test_scripted_demonstrations_of_the_tool_env_solve_every_task(tmp_path):
    """examples/shopping_demos.py: the README's tool env played by ScriptedEngine, through the rollout manager."""
    import subprocess
    import sys

    out = tmp_path / "demos.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "shopping_demos.py"), "-n", "8", "--out",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    demos = list(read_jsonl(out))
    assert len(demos) == 8 and all(t.reward == 1.0 and t.metrics["tool_calls"] >= 2 for t in demos)


def test_a_lora_rank_writes_a_peft_adapter_folder_that_loads_merged_into_its_base(rollouts, tmp_path, capsys):
    out = tmp_path / "adapter"
    assert main(["sft", str(rollouts), "--model", str(WARM_START), "--out", str(out), "--min-reward", "1",
                 "--epochs", "1", "--lr", "1e-3", "--lora-rank", "4"]) == 0
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    tuned, base = load_model(str(out)), load_model(str(WARM_START))
    assert type(tuned.model) is type(base.model) and tuned.tokenizer.chat_template == base.tokenizer.chat_template
    changed = [k for k, v in tuned.model.state_dict().items() if not torch.equal(v, base.model.state_dict()[k])]
    assert changed and all(k.endswith("_proj.weight") for k in changed)  # the adapted layers, merged
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:  # argparse's own exit: one line naming the flag
        main(["sft", str(rollouts), "--model", str(WARM_START), "--out", str(tmp_path / "zero"), "--lora-rank", "0"])
    assert stopped.value.code == 2 and "--lora-rank: must be at least 1, got 0" in capsys.readouterr().err
