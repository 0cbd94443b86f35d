"""`relax-gym eval`: pass@k's estimator, its report, and the same held-out figures a training run logs."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from relax_gym.cli import main
from relax_gym.rollout.evaluation import EVAL_SEED_OFFSET, eval_report, interval, pass_at_k
from relax_gym.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[2]
#: the quickstart's env and rollout limits, as flags of `relax-gym eval`
QUICKSTART_TASK = ["--env", "relax/Arithmetic-v0", "--env-arg", "digits=1", "--env-arg", "n_terms=2", "--env-arg",
                   "ops=+", "--max-new-tokens", "4", "--max-turns", "1", "--max-total-tokens", "128"]


@pytest.mark.parametrize(("n", "c", "k"),
                         [(n, c, k) for n in range(1, 7) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_is_the_chance_that_a_k_subset_holds_a_pass(n, c, k):
    subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_refuses_counts_that_cannot_be():
    for n, c, k in [(4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_the_interval_is_the_normal_one_clipped_to_the_unit_range():
    assert interval([1.0]) == (1.0, 1.0)
    low, high = interval([0.0, 1.0] * 16)  # mean 0.5, sd ~0.508, n 32
    assert low == pytest.approx(0.5 - 1.959964 * 0.50800 / 32 ** 0.5, abs=1e-4) and high == pytest.approx(1 - low)
    assert interval([0.0] * 31 + [1.0])[0] == 0.0


def _trajectory(task: int, reward: float, status: str = "completed", generated: int = 3) -> Trajectory:
    return Trajectory(token_ids=[1] * (2 + generated), prompt_len=2, loss_mask=[0, 0] + [1] * generated,
                      rollout_logprobs=[0.0, 0.0] + [-0.1] * generated, versions=[-1, -1] + [0] * generated,
                      reward=reward, step_rewards=[reward], status=status, group_id=f"env#{task}")  # type: ignore[arg-type]


def test_a_report_counts_full_credit_as_a_pass_and_a_failed_episode_never():
    trajectories = [_trajectory(0, 1.0), _trajectory(0, 0.0), _trajectory(1, 0.5), _trajectory(1, 1.0, "failed")]
    report = eval_report("env", trajectories, k=2)
    assert (report.tasks, report.samples_per_task) == (2, 2)
    assert report.pass_at_1 == pytest.approx(0.25) and report.pass_at_k == pytest.approx(0.5)
    assert report.status == {"completed": 3, "failed": 1} and report.generated_tokens_mean == 3
    assert eval_report("env", trajectories, k=1, pass_reward=0.5).pass_at_1 == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same number"):
        eval_report("env", trajectories[:3], k=1)


@pytest.mark.parametrize(("samples", "temperature"), [(1, 0.0), (3, 0.5)], ids=["greedy", "sampled"])
def test_eval_of_a_runs_checkpoint_gives_the_runs_own_eval_row(samples, temperature, tmp_path, capsys):
    """The run's eval at step 2 and `relax-gym eval` of its step-2 checkpoint: the same tasks, the same answers,
    greedy (the default) or sampled (`trainer.eval_samples` at `trainer.eval_temperature`, the same draws)."""
    run = tmp_path / "run"
    assert main(["train", str(ROOT / "examples" / "configs" / "quickstart.yaml"), f"run_dir={run}",
                 "trainer.total_steps=2", "trainer.mode=sync", "trainer.max_staleness=0", "trainer.checkpoint_every=2",
                 "trainer.eval_every=2", "trainer.eval_tasks=16", "rollout.groups_per_step=2",
                 "rollout.group_size=4", f"trainer.eval_samples={samples}",
                 f"trainer.eval_temperature={temperature}"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = next(r for r in rows if r.get("type") == "eval" and r["step"] == 2)["per_env"]["relax/Arithmetic-v0"]
    capsys.readouterr()
    out = tmp_path / "eval.jsonl"
    assert main(["eval", "--model", str(run), *QUICKSTART_TASK, "-n", "16", "--samples", str(samples),
                 "--temperature", str(temperature), "--out", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("tasks", "samples_per_task", "pass_at_1", "pass_at_1_ci", "reward_mean", "status",
                "generated_tokens_mean"):
        assert got[key] == logged[key], key
    seeds = sorted(json.loads(line)["seed"] for line in out.read_text().splitlines())
    assert seeds == sorted([EVAL_SEED_OFFSET + i for i in range(16)] * samples)


def test_a_config_refuses_several_greedy_eval_samples():
    from relax_gym.trainer.config import load_config

    with pytest.raises(ValueError, match="one greedy answer repeated"):
        load_config(ROOT / "examples" / "configs" / "quickstart.yaml", ["trainer.eval_samples=4"])


def test_eval_samples_k_per_task_and_says_what_it_found(tmp_path, capsys):
    out = tmp_path / "eval.jsonl"
    assert main(["eval", "--model", str(ROOT / "examples" / "checkpoints" / "tiny-arithmetic"), *QUICKSTART_TASK,
                 "-n", "6", "--k", "4", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "6 held-out tasks x 4 samples at temperature 1" in said and "pass@4" in said and str(out) in said
    assert len(out.read_text().splitlines()) == 24


@pytest.mark.parametrize(("flags", "cause"), [
    (["--k", "2", "--temperature", "0"], "at temperature 0 are one answer repeated"),
    (["--k", "3", "--samples", "2"], "pass@k needs 1 <= k <= samples per task"),
])
def test_eval_refuses_settings_that_cannot_measure_pass_at_k(flags, cause, tmp_path, capsys):
    code = main(["eval", "--model", "tiny", *QUICKSTART_TASK, "-n", "2", "--out", str(tmp_path / "x.jsonl"), *flags])
    said = capsys.readouterr().out
    assert code == 2 and cause in said.replace("\n", " "), said


@pytest.mark.parametrize("run_seed", [0, 7, 999, 1000, 12345, 2**31 - 1])
def test_training_seeds_never_reach_the_held_out_ones_whatever_the_runs_seed(run_seed):
    from relax_gym.trainer.loop import task_of_seed, task_seed

    seeds = [task_seed(run_seed, task) for task in (0, 1, 5000, 10**6)]
    assert all(0 <= s < EVAL_SEED_OFFSET for s in seeds)
    assert [task_of_seed(run_seed, s) for s in seeds] == [0, 1, 5000, 10**6]
    if run_seed < 999:  # the seeds runs had before the wrap: resuming one replays the same tasks
        assert seeds == [run_seed * 1_000_003 + task for task in (0, 1, 5000, 10**6)]
