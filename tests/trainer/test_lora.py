"""LoRA (`trainer.lora`, `relax_gym.models.lora`): only the adapter trains, the engines get the merged layers, a
checkpoint is a PEFT adapter folder that plain peft loads, a resume is exact, export merges, and every bad setting
is one line naming the field."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from relax_gym.engines import EmbeddedEngine
from relax_gym.models import load_model
from relax_gym.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraError, LoraSpec, linear_names
from relax_gym.trainer.backends.torch_backend import TorchBackend
from relax_gym.trainer.batch import MicroBatch, Sample
from relax_gym.trainer.config import ConfigError, load_config
from relax_gym.trainer.export import ExportError, export_checkpoint

SPEC = LoraSpec(rank=4, alpha=8)
ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "configs" / "quickstart.yaml"
WARM_START = ROOT / "examples" / "checkpoints" / "tiny-arithmetic"


def _pg_loss(mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    return -(mb.logprobs * mb.advantages * mb.mask).sum() / mb.step_tokens, {}


def _samples(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, 200) for _ in range(rng.randrange(6, 12))]
        mask = [0] * 3 + [1] * (len(ids) - 3)
        out.append(Sample(ids, mask, [0.0] * len(ids), advantage=rng.choice([-1.0, 1.0])))
    return out


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_only_the_adapter_trains_and_the_engines_get_each_adapted_layers_merged_weight():
    base = load_model("tiny")
    before = {k: v.clone() for k, v in base.model.state_dict().items()}
    backend = TorchBackend(load_model("tiny"), lr=1e-2, lora=SPEC)
    trained = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    for _ in range(2):
        backend.train_step(_samples(4), _pg_loss)

    frozen = {k.replace(".base_layer.", "."): v for k, v in backend.model.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(frozen[k], v) for k, v in before.items())  # the base is untouched
    merged = backend.hf_state_dict()
    assert set(merged) == {f"{n}.weight" for n, m in base.model.named_modules()
                           if n.rsplit(".", 1)[-1] in linear_names(base.model) and isinstance(m, torch.nn.Linear)}
    assert any(not torch.equal(merged[k], before[k]) for k in merged)
    # an engine that loaded the base and takes the merged layers answers as the trained adapter does
    engine = EmbeddedEngine(base)
    try:
        asyncio.run(engine.update_weights(merged, 2))
    finally:
        asyncio.run(engine.close())
    ids = _samples(1, seed=9)[0].token_ids
    assert torch.allclose(_logits(base.model, ids), _logits(backend.model, ids), atol=1e-5)


def test_a_checkpoint_is_a_peft_adapter_folder_that_plain_peft_loads_and_a_resume_is_exact(tmp_path):
    first, second = _samples(4, seed=1), _samples(4, seed=2)
    run = TorchBackend(load_model("tiny"), lr=1e-2, lora=SPEC)
    run.train_step(first, _pg_loss)
    run.save_checkpoint(tmp_path / "ckpt", {"position": 3})
    expected = run.train_step(second, _pg_loss)

    folder = tmp_path / "ckpt"
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert not (folder / "config.json").exists()  # the base is not copied into every checkpoint
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["base_model_name_or_path"] == "tiny"
    assert sorted(config["target_modules"]) == linear_names(load_model("tiny").model)

    plain = PeftModel.from_pretrained(load_model("tiny").model, str(folder))  # peft itself, on a fresh base
    resumed = TorchBackend(load_model("tiny"), lr=1e-2, lora=SPEC, seed=5)
    assert resumed.load_checkpoint(folder) == {"position": 3}
    ids = first[0].token_ids
    assert torch.allclose(_logits(plain, ids), _logits(resumed.model, ids), atol=1e-6)
    got = resumed.train_step(second, _pg_loss)
    assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(resumed.hf_state_dict().values(), run.hf_state_dict().values(),
                                                  strict=True))


def test_a_resume_refuses_an_adapter_of_another_shape_or_another_kind_of_checkpoint(tmp_path):
    TorchBackend(load_model("tiny"), lora=SPEC).save_checkpoint(tmp_path / "lora", {})
    TorchBackend(load_model("tiny")).save_checkpoint(tmp_path / "full", {})
    with pytest.raises(LoraError, match=r"its r is 4, the run's trainer.lora says 8"):
        TorchBackend(load_model("tiny"), lora=LoraSpec(rank=8, alpha=8)).load_checkpoint(tmp_path / "lora")
    with pytest.raises(LoraError, match="holds a LoRA adapter, but this run trains full weights"):
        TorchBackend(load_model("tiny")).load_checkpoint(tmp_path / "lora")
    with pytest.raises(LoraError, match=r"holds full weights, but this run has trainer\.lora"):
        TorchBackend(load_model("tiny"), lora=SPEC).load_checkpoint(tmp_path / "full")
    # an adapter of the same rank and layers, trained on another base (an audio model: more q_projs, other names)
    q_only = LoraSpec(rank=4, alpha=8, target_modules=["q_proj"])
    TorchBackend(load_model("tiny-audio"), lora=q_only).save_checkpoint(tmp_path / "audio", {})
    with pytest.raises(LoraError, match=r"adapter .*audio has weights the model lacks \(another base\?\)"):
        TorchBackend(load_model("tiny"), lora=q_only).load_checkpoint(tmp_path / "audio")


def test_a_target_the_model_lacks_is_named_with_the_layers_it_has():
    with pytest.raises(LoraError, match=r"trainer.lora.target_modules: \['qkv'\] is not a linear layer of "
                                        r"Qwen3ForCausalLM; its linear layers are \['down_proj', "):
        TorchBackend(load_model("tiny"), lora=LoraSpec(target_modules=["q_proj", "qkv"]))


@pytest.mark.parametrize("override, said", [
    ("trainer.lora={rank: 0}", "trainer.lora.rank"),
    ("trainer.lora={dropout: 1.5}", "trainer.lora.dropout"),
    ("trainer.lora={rnak: 4}", "trainer.lora.rnak"),
])
def test_bad_lora_settings_are_config_errors_naming_the_key(override, said):
    with pytest.raises(ConfigError, match=said.replace(".", r"\.")):
        load_config(None, ["model=tiny", "envs=[{id: relax/Arithmetic-v0}]", override])


def test_lora_on_the_megatron_backend_is_refused_naming_the_torch_backend():
    with pytest.raises(ConfigError, match=r"trainer\.lora needs trainer\.backend=torch"):
        load_config(None, ["model=tiny", "envs=[{id: relax/Arithmetic-v0}]", "trainer.backend=megatron",
                           "trainer.lora={rank: 4}"])


def test_alpha_defaults_to_twice_the_rank():
    cfg = load_config(None, ["model=tiny", "envs=[{id: relax/Arithmetic-v0}]", "trainer.lora={rank: 8}"])
    assert cfg.trainer.lora is not None and cfg.trainer.lora.spec() == LoraSpec(rank=8, alpha=16)


def test_a_lora_run_trains_resumes_loads_as_a_model_and_exports_merged(tmp_path, capsys):
    from relax_gym.cli import main

    run = tmp_path / "run"
    args = ["train", str(QUICKSTART), f"run_dir={run}", f"model={WARM_START}", "rollout.group_size=2",
            "rollout.groups_per_step=2", "trainer.eval_every=0", "trainer.checkpoint_every=1",
            "trainer.lora={rank: 4}"]
    assert main([*args, "trainer.total_steps=1"]) == 0, capsys.readouterr()
    assert main([*args, "trainer.total_steps=2"]) == 0, capsys.readouterr()  # resumes from step 1
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert steps == [1, 2]
    step = run / "checkpoints" / "step_2"
    assert (step / ADAPTER_CONFIG).is_file() and not (step / "config.json").exists()

    as_model = load_model(str(run))  # a run folder loads as its latest step, merged into its base
    assert as_model.name == str(step)
    base = json.loads((step / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    assert base == str(WARM_START)  # absolute, so the adapter loads from any folder

    assert main(["export", str(run), "-o", str(tmp_path / "adapter")]) == 0
    assert (tmp_path / "adapter" / ADAPTER_WEIGHTS).is_file()
    assert main(["export", str(run), "-o", str(tmp_path / "merged"), "--merge"]) == 0
    merged = load_model(str(tmp_path / "merged"))
    assert (tmp_path / "merged" / "config.json").is_file() and not (tmp_path / "merged" / ADAPTER_CONFIG).exists()
    ids = [5, 9, 13, 17]
    assert torch.allclose(_logits(merged.model, ids), _logits(as_model.model, ids), atol=1e-6)


def test_merge_on_a_full_weights_checkpoint_says_there_is_no_adapter(tmp_path):
    from relax_gym.trainer.checkpoint import CheckpointManager

    backend = TorchBackend(load_model("tiny"))
    CheckpointManager(tmp_path / "checkpoints").save(backend, 1, {})
    with pytest.raises(ExportError, match=r"holds full weights .* export it without --merge"):
        export_checkpoint(tmp_path, tmp_path / "out", merge=True)


def test_a_run_whose_targets_the_model_lacks_stops_in_one_line(tmp_path, capsys):
    from relax_gym.cli import main

    code = main(["train", str(QUICKSTART), f"run_dir={tmp_path / 'run'}", "model=tiny", "trainer.total_steps=1",
                 "trainer.lora={rank: 4, target_modules: [q_proj, qkv]}"])
    said = capsys.readouterr()
    assert code == 2 and "trainer.lora.target_modules: ['qkv'] is not a linear layer of Qwen3ForCausalLM" in said.out
    assert "Traceback" not in said.out + said.err
