"""Every example config trains a few steps with its model, and the update reaches the whole model (with
`trainer.lora`, every adapted layer and nothing else).

The tiny models are random, so their rewards (and advantages) are all zero;
a small entropy bonus gives every trained token a gradient, which then has to
flow through the language model and, where there is one, the vision or audio
tower that produced the embeddings those tokens attended to.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from relax_gym.models import load_model
from relax_gym.models.lora import linear_names
from relax_gym.trainer.config import load_config
from relax_gym.trainer.loop import Trainer

ROOT = Path(__file__).resolve().parents[2]
#: configs whose model is a `relax-gym sft` folder made from SmolLM2 with the chatml-tools template
LADDER_RL_RUNGS = {"smollm2_shopping", "smollm2_gsm8k_steps"}
CONFIGS = sorted(p for p in (ROOT / "examples" / "configs").glob("*.yaml") if not p.name.startswith("gpu"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_example_config_trains_and_updates_every_parameter(tmp_path, path, request):
    smollm2 = request.getfixturevalue("smollm2") if "smollm2" in path.stem else None  # made if this machine lacks it
    qwen_coder = request.getfixturevalue("qwen_coder") if "qwen_coder" in path.stem else None
    cfg = load_config(path, [
        f"run_dir={tmp_path / 'run'}", "trainer.total_steps=2", "trainer.checkpoint_every=2",
        "trainer.eval_every=0", "rollout.groups_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=8", "algorithm.entropy_coef=0.01", "trainer.lr=1e-3",
    ])
    cfg.model.path = str(Path(cfg.model.path).expanduser())
    if not Path(cfg.model.path).is_absolute() and (ROOT / cfg.model.path).is_dir():
        cfg.model.path = str(ROOT / cfg.model.path)
    if path.stem in LADDER_RL_RUNGS:  # a ladder's RL rung starts from its sft rung's folder: from SmolLM2 here,
        cfg.model.path, cfg.model.chat_template = str(smollm2), "chatml-tools"  # with the template sft saves
    if qwen_coder is not None:  # where the fixture made it ($RELAX_GYM_MODEL_CACHE may move it from the config's)
        cfg.model.path = str(qwen_coder)
    for env in cfg.envs:  # an env file named relative to the clone
        file, sep, env_id = env.id.partition(":")
        if sep and (ROOT / file).is_file():
            env.id = f"{ROOT / file}:{env_id}"
    model = load_model(cfg.model.path).model
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}  # e.g. not sinusoidal tables
    if cfg.trainer.lora is not None:  # a LoRA run moves the adapted linear layers only (merged into the checkpoint)
        adapted = set(linear_names(model))
        trainable = {name for name in trainable if name.endswith(".weight") and name.split(".")[-2] in adapted}
    summary = asyncio.run(Trainer(cfg).run())
    assert summary["steps"] == 2
    trained = load_model(str(tmp_path / "run" / "checkpoints" / "step_2")).model.state_dict()  # a model folder
    unchanged = [k for k in trainable if torch.equal(trained[k], initial[k])]
    assert not unchanged, f"parameters the update never reached: {unchanged}"
    moved = [k for k in initial.keys() - trainable if not torch.equal(trained[k], initial[k])]
    assert not moved or cfg.trainer.lora is None, f"a LoRA run moved frozen parameters: {moved}"
    towers = [k for k in trainable if any(t in k for t in ("visual", "vision", "audio_tower", "multi_modal"))]
    if any(m in cfg.model.path for m in ("vl", "audio", "omni")):
        assert towers  # the towers exist and (above) every one of their parameters moved


def test_the_gpu_config_is_complete_and_valid():
    cfg = load_config(ROOT / "examples" / "configs" / "gpu_qwen3_sglang_megatron.yaml")
    assert (cfg.rollout.engine, cfg.trainer.backend, cfg.trainer.megatron.tp) == ("sglang", "megatron", 2)
