"""Checkpoints are models: every `step_N/` loads with `load_model` and plain transformers, and exports cleanly.

One short real training run (module-scoped) is shared by the run-level tests;
the VL / audio folders and the exact-resume checks go through the backend's
own save, with no run. The Megatron backend's step folders are checked in
test_megatron_backend.py / test_megatron_loop.py (its existing launches).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForMultimodalLM,
    AutoProcessor,
    AutoTokenizer,
)
from transformers.utils import is_torchvision_available

from relax_gym.cli import main
from relax_gym.models import TINY_MODELS, ModelLoadError, load_model
from relax_gym.trainer.backends import TorchBackend
from relax_gym.trainer.checkpoint import MANIFEST, write_manifest
from relax_gym.trainer.config import load_config
from relax_gym.trainer.export import ExportError, export_checkpoint
from relax_gym.trainer.loop import Trainer

ROOT = Path(__file__).resolve().parents[2]
WARM_START = ROOT / "examples" / "checkpoints" / "tiny-arithmetic"
#: what a text model's step folder holds: the HF model folder, then the torch backend's training state
HF_TEXT_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja"}
TRAINING_STATE = {"optimizer.pt", "trainer_state.pt"}
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    different = [k for k, v in want.items() if not torch.equal(got[k], v)]
    assert not different, f"weights that differ: {different[:5]}"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two training steps of the warm-start model, checkpointed after each; the trained weights, held in memory."""
    run_dir = tmp_path_factory.mktemp("checkpoint-models") / "run"
    cfg = load_config(None, [
        # the warm start's task (sums), groups of 4: some group has mixed rewards, so the steps move the weights
        f"run_dir={run_dir}", f"model={WARM_START}", "envs=[{id: relax/Arithmetic-v0, kwargs: {digits: 1, ops: '+'}}]",
        "rollout.group_size=4", "rollout.groups_per_step=4", "rollout.temperature=0.5", "rollout.max_new_tokens=4",
        "rollout.max_turns=1", "trainer.total_steps=2", "trainer.lr=1e-3", "trainer.checkpoint_every=1",
        "trainer.eval_every=0",
    ])
    trainer = Trainer(cfg)
    asyncio.run(trainer.run())
    template = trainer.loaded.tokenizer.chat_template
    return {"dir": run_dir, "trained": _state(trainer.backend.model), "template": template}


def test_a_step_folder_is_a_model_folder_plus_the_training_state_all_in_the_manifest(run):
    step = run["dir"] / "checkpoints" / "step_2"
    files = {p.name for p in step.iterdir()}
    assert files == HF_TEXT_FILES | TRAINING_STATE | {MANIFEST}
    assert set(json.loads((step / MANIFEST).read_text())["files"]) == files - {MANIFEST}
    with safe_open(step / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert "lm_head.weight" not in names  # tied to the embeddings: stored once, as save_pretrained does


@pytest.mark.parametrize("where", ["checkpoints/latest", "checkpoints", ".", "checkpoints/step_2"])
def test_load_model_takes_the_latest_pointer_the_checkpoints_folder_the_run_or_a_step(run, where):
    loaded = load_model(str(run["dir"] / where))
    assert loaded.name == str(run["dir"] / "checkpoints" / "step_2")
    _assert_same_weights(_state(loaded.model), run["trained"])
    assert loaded.tokenizer.chat_template == run["template"]


def test_each_step_holds_its_own_weights(run):
    first = _state(load_model(str(run["dir"] / "checkpoints" / "step_1")).model)
    assert any(not torch.equal(first[k], v) for k, v in run["trained"].items())


def test_plain_transformers_loads_a_step_with_its_tokenizer_and_chat_template(run):
    step = run["dir"] / "checkpoints" / "step_2"
    model = AutoModelForCausalLM.from_pretrained(step, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(step, local_files_only=True)
    _assert_same_weights(_state(model), run["trained"])
    assert tokenizer.chat_template == run["template"]
    warm = AutoTokenizer.from_pretrained(WARM_START, local_files_only=True)
    render = {"add_generation_prompt": True, "tokenize": False}
    assert tokenizer.apply_chat_template(MESSAGES, **render) == warm.apply_chat_template(MESSAGES, **render)
    assert model.generation_config.eos_token_id == load_model(str(WARM_START)).model.generation_config.eos_token_id


def test_rollout_runs_on_the_latest_checkpoint(run, tmp_path, capsys):
    out = tmp_path / "episodes.jsonl"
    code = main(["rollout", "--env", "relax/Arithmetic-v0", "--model", str(run["dir"] / "checkpoints" / "latest"),
                 "-n", "1", "--out", str(out), "--max-new-tokens", "4", "--max-turns", "1"])
    assert code == 0, capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 1


def test_export_writes_only_the_model_folder_and_it_loads_in_plain_transformers(run, tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["export", str(run["dir"]), "-o", str(out)]) == 0
    assert "step_2" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == HF_TEXT_FILES
    _assert_same_weights(_state(AutoModelForCausalLM.from_pretrained(out, local_files_only=True)), run["trained"])
    assert AutoTokenizer.from_pretrained(out, local_files_only=True).chat_template == run["template"]
    assert not list(tmp_path.glob(".*export-partial"))

    older = tmp_path / "step1"
    older.mkdir()  # an empty folder is fine
    assert main(["export", str(run["dir"]), "--step", "1", "-o", str(older)]) == 0
    _assert_same_weights(_state(load_model(str(older)).model),
                         _state(load_model(str(run["dir"] / "checkpoints" / "step_1")).model))


def test_export_refuses_a_folder_with_files_a_missing_step_and_a_damaged_checkpoint(run, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert main(["export", str(run["dir"]), "-o", str(taken)]) == 2
    assert "not an empty folder" in capsys.readouterr().out
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]

    assert main(["export", str(run["dir"]), "--step", "9", "-o", str(tmp_path / "nine")]) == 2
    out = capsys.readouterr().out
    assert "step_9 is missing" in out and "[1, 2]" in out

    copy = tmp_path / "copy" / "checkpoints"
    shutil.copytree(run["dir"] / "checkpoints", copy)
    tokenizer = copy / "step_2" / "tokenizer.json"
    data = bytearray(tokenizer.read_bytes())
    data[len(data) // 2] ^= 1  # the same size, one bit off
    tokenizer.write_bytes(bytes(data))
    damaged = tmp_path / "damaged"
    assert main(["export", str(copy / "latest"), "-o", str(damaged)]) == 2
    out = capsys.readouterr().out
    assert "tokenizer.json" in out and "does not match" in out and "Traceback" not in out
    assert not damaged.exists() and not list(tmp_path.glob(".*export-partial"))


@pytest.mark.parametrize(("content", "error"), [("7", "names step 7, but"), ("garbage", "not a step number")])
def test_a_pointer_to_no_step_is_an_error_naming_the_pointer(tmp_path, content, error):
    pointer = tmp_path / "checkpoints" / "latest"
    pointer.parent.mkdir()
    pointer.write_text(content)
    for given in (pointer, pointer.parent, tmp_path):
        with pytest.raises(ModelLoadError) as raised:
            load_model(str(given))
        assert str(pointer) in str(raised.value) and error in str(raised.value)


# --- through the backend's own save, no run -----------------------------------------------------


def _perturbed_backend(name: str) -> TorchBackend:
    """A backend whose weights are no longer the tiny model's initial ones (as after training)."""
    backend = TorchBackend(load_model(name), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in backend.model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.01)
    return backend


@pytest.mark.parametrize(("name", "auto_model"), [("tiny-vl", AutoModelForImageTextToText),
                                                  ("tiny-audio", AutoModelForMultimodalLM)])
def test_vl_and_audio_step_folders_load_with_the_auto_classes(tmp_path, name, auto_model):
    backend = _perturbed_backend(name)
    backend.save_checkpoint(tmp_path, {})
    model = auto_model.from_pretrained(tmp_path, local_files_only=True)
    assert type(model) is type(backend.model)
    _assert_same_weights(_state(model), _state(backend.model))
    if name == "tiny-vl" and not is_torchvision_available():
        # AutoProcessor builds Qwen3-VL's video processor, which needs torchvision; load_model leaves it out
        processor = load_model(str(tmp_path)).processor
    else:
        processor = AutoProcessor.from_pretrained(tmp_path, local_files_only=True)
    original = backend.loaded.processor
    assert type(processor).__name__ == type(original).__name__
    assert processor.chat_template == original.chat_template
    assert processor.tokenizer.get_vocab() == original.tokenizer.get_vocab()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_resume_restores_the_weights_bit_for_bit_from_the_one_copy_saved(tmp_path, name):
    backend = _perturbed_backend(name)
    backend.save_checkpoint(tmp_path, {"step": 1})
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        saved_names = set(weights.keys())
    if name == "tiny-audio":  # save_pretrained's names are the original checkpoint layout's, not the in-memory ones
        assert "audio_tower.conv1.weight" in saved_names
        assert "model.audio_tower.conv1.weight" in backend.model.state_dict()
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]  # the weights, once

    resumed = TorchBackend(load_model(name), lr=1e-3, seed=5)
    assert resumed.load_checkpoint(tmp_path) == {"step": 1}
    _assert_same_weights(_state(resumed.model), _state(backend.model))


def test_a_checkpoint_from_before_checkpoints_were_model_folders_still_resumes(tmp_path):
    """model.safetensors under in-memory names and no config.json: what relax_gym wrote before."""
    backend = _perturbed_backend("tiny-audio")
    backend.save_checkpoint(tmp_path, {"step": 1})
    for path in tmp_path.iterdir():
        if path.name not in TRAINING_STATE:
            path.unlink()
    safetensors.torch.save_model(backend.model, str(tmp_path / "model.safetensors"))
    resumed = TorchBackend(load_model("tiny-audio"), lr=1e-3)
    assert resumed.load_checkpoint(tmp_path) == {"step": 1}
    _assert_same_weights(_state(resumed.model), _state(backend.model))

    write_manifest(tmp_path)  # it resumes, but it holds no model folder to export
    with pytest.raises(ExportError, match="before checkpoints were model folders"):
        export_checkpoint(tmp_path, tmp_path.parent / "exported")
