"""`trainer.own_process`: the backend in a spawned child process trains exactly as in-process (the samples crossing
once a step), checkpoints and resumes through it, and a child that dies stops the run with its exit code."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from relax_gym.errors import RunStopped
from relax_gym.trainer.backends.process import ProcessBackend, TrainerProcessError
from relax_gym.trainer.config import ConfigError, load_config
from relax_gym.trainer.loop import Trainer

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("reward_mean", "train/loss", "train/grad_norm", "trained_samples")


def _config(run_dir: Path, *overrides: str):
    return load_config(None, [
        f"run_dir={run_dir}", f"model={ROOT / 'examples' / 'checkpoints' / 'tiny-arithmetic'}",
        "envs=[{id: relax/Arithmetic-v0, kwargs: {digits: 1, ops: '+'}}]", "rollout.group_size=4",
        "rollout.groups_per_step=3", "rollout.temperature=0.5", "rollout.max_new_tokens=4", "rollout.max_turns=1",
        "trainer.mode=sync", "trainer.lr=1e-3", "trainer.checkpoint_every=2", "trainer.total_steps=4", *overrides,
    ])


def _rows(run_dir: Path) -> list[list]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [[r[k] for k in KEYS] for r in rows if r["type"] == "train"]


@pytest.mark.timeout(300)
def test_a_trainer_in_its_own_process_trains_checkpoints_and_resumes_like_the_in_process_one(tmp_path):
    asyncio.run(Trainer(_config(tmp_path / "here")).run())
    apart = tmp_path / "apart"
    first = Trainer(_config(apart, "trainer.own_process=true", "trainer.total_steps=2"))
    assert isinstance(first.backend, ProcessBackend)
    calls: list[str] = []
    forward = first.backend._call
    first.backend._call = lambda method, *a, **kw: (calls.append(method), forward(method, *a, **kw))[1]  # type: ignore[method-assign]
    asyncio.run(first.run())
    # one backend call a step carries the samples: the old logprobs are taken in the update's own call
    assert first.cfg.algorithm.recompute_old_logprobs and calls.count("train_step") == 2 and "logprobs" not in calls
    assert not first.backend._process.is_alive()  # stopped with the run
    resumed = Trainer(_config(apart, "trainer.own_process=true"))
    summary = asyncio.run(resumed.run())
    assert summary["resumed_from"] == 2
    expected = _rows(tmp_path / "here")
    assert _rows(apart) == expected and any(r[2] > 0 for r in expected)


@pytest.mark.timeout(120)
def test_a_trainer_process_that_dies_stops_the_run_naming_its_exit_code(tmp_path):
    trainer = Trainer(_config(tmp_path / "run", "trainer.own_process=true"))
    trainer.backend._process.kill()
    with pytest.raises(TrainerProcessError, match=r"exit code -9") as raised:
        asyncio.run(trainer.run())
    assert isinstance(raised.value, RunStopped)


def test_own_process_and_a_cluster_are_refused_together(tmp_path):
    with pytest.raises(ConfigError, match="own_process"):
        _config(tmp_path / "run", "trainer.own_process=true", "cluster.mode=ray")
