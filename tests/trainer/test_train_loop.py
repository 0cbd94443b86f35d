"""The train loop end to end on the real tiny model: run folder, staleness, resume, interruption."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.engine_doubles import JitteryEngine, PushRecorder

import relax_gym
from relax_gym.envs.procedural import GuessNumberEnv
from relax_gym.errors import RunStopped
from relax_gym.trainer.config import load_config
from relax_gym.trainer.launch import train
from relax_gym.trainer.loop import Trainer

ROOT = Path(__file__).resolve().parents[2]
WARM_START = ROOT / "examples" / "checkpoints" / "tiny-arithmetic"


def config(tmp_path: Path, *overrides: str):
    base = [
        f"run_dir={tmp_path / 'run'}",
        # the warm start answers its sums right ~10% of the time, so some groups have non-zero advantages
        f"model={WARM_START}",
        "envs=[{id: relax/Arithmetic-v0, kwargs: {digits: 1, ops: '+'}}]",
        "rollout.group_size=4",
        "rollout.groups_per_step=4",
        "rollout.temperature=0.5",
        "rollout.max_new_tokens=4",
        "rollout.max_turns=1",
        "trainer.total_steps=3",
        "trainer.lr=1e-3",
        "trainer.checkpoint_every=2",
    ]
    return load_config(None, [*base, *overrides])


def train_records(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["type"] == "train"]


def test_a_short_run_leaves_metrics_checkpoints_tensorboard_and_a_plot(tmp_path):
    summary = train(config(tmp_path, "trainer.eval_every=3", "trainer.eval_tasks=4"))
    run = tmp_path / "run"
    rows = train_records(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["trained_samples"] > 0 for r in rows)
    assert any(r["train/grad_norm"] > 0 for r in rows)
    assert {"wait_rollout_s", "train_s", "weight_sync_s", "staleness", "tokens_per_s"} <= set(rows[0])
    assert all(r["cpu_s"] > 0 for r in rows)  # the process's CPU seconds over the step
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert [e["step"] for e in evals] == [0, 3]  # the starting model, then every 3 steps
    assert (run / "reward.png").stat().st_size > 0
    assert (run / "checkpoints" / "latest").read_text() == "3"
    assert any((run / "tensorboard").iterdir())
    trajs = (run / "trajectories.jsonl").read_text().splitlines()
    assert len(trajs) == 3 * 4 * 4
    assert summary["steps"] == 3


def test_a_run_written_to_a_file_says_its_progress_and_its_checkpoint_size_and_keeps_what_it_is_told(
        tmp_path, capsys):
    """Output that is not a terminal gets no progress bar: plain lines instead (the first and last step at least);
    the first checkpoint's size is stated; `trainer.keep_checkpoints` step folders stay."""
    train(config(tmp_path, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2"))
    said = capsys.readouterr().out
    assert "step 1/3: reward" in said and "step 3/3: reward" in said and "s/step" in said, said
    assert "checkpoint step_1: " in said and "MB (weights and optimizer state)" in said, said
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_2", "step_3"]


class SlowGuess(GuessNumberEnv):
    """GuessNumber whose steps take a random time, as a slow tool or judge would."""

    def step(self, action):
        time.sleep(random.random() * 0.01)
        return super().step(action)


@pytest.mark.parametrize("k", [0, 1, 4])
def test_no_trained_sample_exceeds_max_staleness_with_random_latencies(tmp_path, k):
    relax_gym.register("test/SlowGuess-v0", SlowGuess)
    random.seed(k)
    cfg = config(tmp_path, "envs=[{id: test/SlowGuess-v0, kwargs: {high: 8}}]", "rollout.max_turns=3",
                 "rollout.groups_per_step=3", f"trainer.max_staleness={k}", "trainer.total_steps=5",
                 "trainer.checkpoint_every=100")
    trainer = Trainer(cfg)
    trainer.engine = JitteryEngine(trainer.engine)
    trainer.manager.engine = trainer.engine
    asyncio.run(trainer.run())
    rows = train_records(tmp_path / "run")
    assert len(rows) == 5
    for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines():
        record = json.loads(line)
        generated = [v for v, m in zip(record["versions"], record["loss_mask"], strict=True) if m]
        trained_at = record["step"] - 1  # the version of the weights that step trained
        assert trained_at - min(generated) <= k
    assert all(int(s) <= k for r in rows for s in r["staleness"])


def test_resuming_continues_from_the_last_checkpoint_without_repeating_steps(tmp_path):
    train(config(tmp_path, "trainer.total_steps=2"))
    summary = train(config(tmp_path, "trainer.total_steps=4"))
    rows = train_records(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert summary["steps"] == 4
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "4"


def _start_training(tmp_path: Path, steps: int) -> subprocess.Popen:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"run_dir: {tmp_path / 'run'}\nmodel: {WARM_START}\nenvs: [{{id: relax/Arithmetic-v0}}]\n"
        "rollout: {group_size: 2, groups_per_step: 2, max_new_tokens: 4, max_turns: 1}\n"
        f"trainer: {{total_steps: {steps}, checkpoint_every: 2, lr: 1.0e-3}}\n"
    )
    return subprocess.Popen([sys.executable, "-m", "relax_gym.cli", "train", str(cfg)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_checkpoint(tmp_path: Path, proc: subprocess.Popen, step: int, timeout: float = 240) -> None:
    latest = tmp_path / "run" / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if latest.is_file() and int(latest.read_text()) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"training exited early:\n{proc.stdout.read()}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("no checkpoint appeared in time")


@pytest.mark.timeout(600)
def test_a_killed_run_resumes_with_nothing_lost(tmp_path):
    proc = _start_training(tmp_path, steps=1000)
    _wait_for_checkpoint(tmp_path, proc, 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    done = int((tmp_path / "run" / "checkpoints" / "latest").read_text())
    logged = [r["step"] for r in train_records(tmp_path / "run")]
    assert logged[: done] == list(range(1, done + 1))  # every step up to the checkpoint was kept
    summary = train(load_config(tmp_path / "cfg.yaml", [f"trainer.total_steps={done + 2}"]))
    assert [r["step"] for r in train_records(tmp_path / "run")] == list(range(1, done + 3))
    assert summary["steps"] == done + 2


@pytest.mark.timeout(600)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_checkpoints_and_plots_before_exiting(tmp_path, signum):
    """Ctrl-C, or SIGTERM (a scheduler's stop), finishes the running step, checkpoints and plots."""
    proc = _start_training(tmp_path, steps=1000)
    _wait_for_checkpoint(tmp_path, proc, 2)
    time.sleep(1.0)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    steps = [r["step"] for r in train_records(tmp_path / "run")]
    assert int((tmp_path / "run" / "checkpoints" / "latest").read_text()) == steps[-1]
    assert (tmp_path / "run" / "reward.png").is_file()


def test_a_killed_run_that_never_checkpointed_starts_afresh_without_its_old_rows(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = [{"type": "train", "step": s, "reward_mean": 0.0} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stale))
    summary = train(config(tmp_path, "trainer.total_steps=1"))
    assert [r["step"] for r in train_records(run_dir)] == [1] and summary["steps"] == 1


@pytest.mark.parametrize("filter_uniform", [False, True])
def test_k0_async_reproduces_the_synchronous_run_exactly(tmp_path, filter_uniform):
    """Same seed: the bus-driven async loop at k = 0 and the plain sync loop train on identical batches.

    The engine runs one request at a time here, so a row's numerics never depend on what it was
    batched with; per-request seeds make the samples independent of request timing.
    """
    runs = {}
    for mode in ("sync", "async"):
        cfg = config(tmp_path / mode, f"trainer.mode={mode}", "trainer.max_staleness=0",
                     "rollout.engine_max_batch_size=1", "rollout.group_size=3", "trainer.total_steps=4",
                     f"algorithm.filter_uniform_groups={str(filter_uniform).lower()}")
        train(cfg)
        runs[mode] = train_records(tmp_path / mode / "run")
    keys = ("reward_mean", "train/loss", "train/grad_norm", "trained_samples")
    assert [[r[k] for k in keys] for r in runs["sync"]] == [[r[k] for k in keys] for r in runs["async"]]
    assert any(r["train/loss"] != 0 for r in runs["sync"])
    if filter_uniform:
        assert runs["sync"][-1]["filtered_total"] == runs["async"][-1]["filtered_total"] > 0  # refills ran


def trainer_recording(cfg, fail_at: int | None = None) -> tuple[Trainer, list[tuple[str, int]]]:
    """A trainer whose pushes and update starts are noted in order; each update takes 0.3 s longer, so the next
    step's groups are ready before it ends."""
    events: list[tuple[str, int]] = []
    trainer = Trainer(cfg)
    trainer.engine = trainer.manager.engine = PushRecorder(trainer.engine, events, fail_at)
    backend, train_step = trainer.backend, trainer.backend.train_step

    def slow_train_step(*args, **kwargs):
        events.append(("training", backend.version + 1))
        time.sleep(0.3)
        return train_step(*args, **kwargs)

    backend.train_step = slow_train_step
    return trainer, events


def test_async_trains_the_next_step_while_the_last_one_is_pushed(tmp_path):
    cfg = config(tmp_path, "trainer.mode=async", "trainer.max_staleness=1", "trainer.total_steps=4",
                 "trainer.checkpoint_every=100")
    trainer, events = trainer_recording(cfg)
    asyncio.run(trainer.run())
    assert [r["step"] for r in train_records(tmp_path / "run")] == [1, 2, 3, 4]
    ahead = [v for v in (2, 3, 4) if events.index(("training", v)) < events.index(("pushed", v - 1))]
    assert ahead, events
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "4"


def test_a_step_trained_ahead_of_a_failed_push_is_logged_and_checkpointed(tmp_path):
    """Step 3 trains while step 2's push fails: the run stops, keeping step 3 in its log and checkpoint, and
    resumes after it."""
    cfg = config(tmp_path, "trainer.mode=async", "trainer.max_staleness=1", "trainer.total_steps=4",
                 "trainer.checkpoint_every=100")
    trainer, events = trainer_recording(cfg, fail_at=2)
    with pytest.raises(RunStopped, match="weights of step 2"):
        asyncio.run(trainer.run())
    assert ("training", 3) in events
    assert [r["step"] for r in train_records(tmp_path / "run")] == [1, 2, 3]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "3"
    train(cfg)
    assert [r["step"] for r in train_records(tmp_path / "run")] == [1, 2, 3, 4]
