"""A run either trains or stops and says why, from the CLI as a user runs it; and it resumes exactly.

Every case here was a run that looped, printed tracebacks, exited 0 having
trained nothing, or lost or repeated tasks across a resume.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch

from relax_gym.cli import main
from relax_gym.engines.base import API_KEY_ENV
from relax_gym.env.registration import env_class, import_env_source
from relax_gym.models import load_model, save_model
from relax_gym.trainer.config import load_config
from relax_gym.trainer.launch import train

ROOT = Path(__file__).resolve().parents[2]
WARM_START = ROOT / "examples" / "checkpoints" / "tiny-arithmetic"

BASE = [
    f"model={WARM_START}",
    "rollout.group_size=2",
    "rollout.groups_per_step=2",
    "rollout.temperature=0.5",
    "rollout.max_new_tokens=4",
    "rollout.max_turns=1",
    "trainer.total_steps=2",
    "trainer.lr=1e-3",
    "trainer.checkpoint_every=1",
]
ARITHMETIC = "envs=[{id: relax/Arithmetic-v0, kwargs: {digits: 1}}]"

#: envs whose failures preflight cannot see: they reset fine once, then fail
FLAKY_ENVS = textwrap.dedent('''
    import relax_gym
    from relax_gym.envs.procedural import ArithmeticEnv

    class BreaksAfterFirstReset(ArithmeticEnv):
        """Resets once (the preflight), then raises the same error on every reset."""
        resets = 0

        def reset(self, *, seed=None, options=None):
            type(self).resets += 1
            if type(self).resets > 1:
                raise RuntimeError("the task server is gone")
            return super().reset(seed=seed, options=options)

    class FailsVariously(ArithmeticEnv):
        """After the preflight's reset, every reset raises, with one of two errors (not one deterministic one)."""
        resets = 0

        def reset(self, *, seed=None, options=None):
            type(self).resets += 1
            if type(self).resets > 1:
                raise (KeyError if seed % 2 else ValueError)(f"bad task {seed}")
            return super().reset(seed=seed, options=options)

    class FailsAtEval(ArithmeticEnv):
        """Training tasks are fine; every held-out (eval) task raises."""

        def reset(self, *, seed=None, options=None):
            if seed is not None and seed >= 1_000_000_000:
                raise RuntimeError("no held-out split")
            return super().reset(seed=seed, options=options)

    class NewTaskRaises(ArithmeticEnv):
        def reset(self, *, seed=None, options=None):
            raise ValueError("new_task: the question bank is empty")

    relax_gym.register("flaky/BreaksAfterFirstReset-v0", BreaksAfterFirstReset)
    relax_gym.register("flaky/FailsVariously-v0", FailsVariously)
    relax_gym.register("flaky/FailsAtEval-v0", FailsAtEval)
    relax_gym.register("flaky/NewTaskRaises-v0", NewTaskRaises)
''')


@pytest.fixture(scope="module")
def flaky_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("envs") / "flaky_envs.py"
    path.write_text(FLAKY_ENVS)
    import_env_source(str(path))
    return path


@pytest.fixture
def flaky(flaky_file) -> Path:
    """The file of flaky envs, their reset counters at 0 (the preflight's reset is the first)."""
    for env_id in ("flaky/BreaksAfterFirstReset-v0", "flaky/FailsVariously-v0"):
        env_class(env_id).resets = 0
    return flaky_file


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def train_cli(capsys, tmp_path: Path, *overrides: str) -> tuple[int, str]:
    return run_cli(capsys, "train", str(write_config(tmp_path)), *BASE, f"run_dir={tmp_path / 'run'}", *overrides)


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(f"envs: [{{id: relax/Arithmetic-v0}}]\nrun_dir: {tmp_path / 'run'}\n")
    return path


def train_rows(run: Path, kind: str = "train") -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["type"] == kind]


# --- preflight: nothing starts --------------------------------------------------------------------
@pytest.mark.parametrize(("envs", "needle"), [
    ("envs=[{id: relax/Arithmetc-v0}]", "Arithmetic-v0"),
    ("envs=[{id: relax/Arithmetic-v0, kwargs: {digitz: 1}}]", "digitz"),
    ("envs=[{id: relax/Math-v0, kwargs: {data_path: /nowhere/math.jsonl}}]", "/nowhere/math.jsonl"),
])
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_an_env_that_cannot_be_built_stops_the_run_before_it_starts(capsys, tmp_path, envs, needle, mode):
    code, out = train_cli(capsys, tmp_path, envs, f"trainer.mode={mode}")
    assert code == 2, out
    assert needle in out and "Traceback" not in out
    assert len(out.splitlines()) <= 3
    assert not (tmp_path / "run").exists()  # nothing is left behind by a run that could not start


@pytest.mark.timeout(180)
def test_async_train_with_a_bad_env_kwarg_exits_at_once_from_a_real_shell(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'run'}\nmodel: {WARM_START}\n"
                   "envs: [{id: relax/Arithmetic-v0, kwargs: {digitz: 1}}]\n"
                   "rollout: {group_size: 2, groups_per_step: 2, max_new_tokens: 4}\n")
    done = subprocess.run([sys.executable, "-m", "relax_gym.cli", "train", str(cfg)], capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 2
    assert "digitz" in done.stdout and "Traceback" not in done.stdout + done.stderr
    assert len(done.stdout) + len(done.stderr) < 2000  # a screenful at most, never a loop of tracebacks


def test_an_env_whose_reset_always_raises_is_named_before_training(capsys, tmp_path, flaky):
    code, out = train_cli(capsys, tmp_path, f"envs=[{{id: '{flaky}:flaky/NewTaskRaises-v0'}}]")
    assert code == 2, out
    assert "flaky/NewTaskRaises-v0" in out and "question bank is empty" in out


def test_a_checkpoint_without_a_chat_template_is_refused(capsys, tmp_path):
    folder = save_model(load_model(str(WARM_START)), tmp_path / "model")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    code, out = train_cli(capsys, tmp_path, f"model={folder}")
    assert code == 2 and "no chat template" in out, out
    code, out = run_cli(capsys, "rollout", "--env", "relax/Arithmetic-v0", "--model", str(folder), "-n", "1",
                        "--out", str(tmp_path / "t.jsonl"))
    assert code == 2 and "no chat template" in out, out


def test_a_prompt_longer_than_the_token_budget_is_refused(capsys, tmp_path):
    code, out = train_cli(capsys, tmp_path, "rollout.max_total_tokens=20")
    assert code == 2, out
    assert "first prompt is" in out and "max_total_tokens >= " in out
    code, out = run_cli(capsys, "rollout", "--env", "relax/Arithmetic-v0", "--model", str(WARM_START), "-n", "1",
                        "--max-total-tokens", "20", "--out", str(tmp_path / "t.jsonl"))
    assert code == 2 and "first prompt is" in out, out


@pytest.mark.parametrize("setup", ["empty config", "no weights", "empty folder"])
def test_a_broken_model_folder_is_one_line(capsys, tmp_path, setup):
    folder = tmp_path / "model"
    folder.mkdir()
    if setup == "empty config":
        (folder / "config.json").write_text("{}")
    elif setup == "no weights":
        save_model(load_model(str(WARM_START)), folder)
        for weights in folder.glob("*.safetensors"):
            weights.unlink()
    code, out = train_cli(capsys, tmp_path, f"model={folder}")
    assert code == 2, out
    assert str(folder) in out and "Traceback" not in out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["a file", "under /proc"])
def test_an_unwritable_run_dir_is_one_line(capsys, tmp_path, where):
    run_dir = tmp_path / "file" if where == "a file" else Path("/proc/relax-gym-run")
    if where == "a file":
        run_dir.write_text("not a folder")
    code, out = train_cli(capsys, tmp_path, ARITHMETIC, f"run_dir={run_dir}")
    assert code == 2, out
    assert f"run_dir {run_dir}: cannot write there" in out


def test_a_config_that_is_not_text_is_one_line(capsys, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_bytes("run_dir: caf\xe9\n".encode("latin-1"))
    code, out = run_cli(capsys, "train", str(path))
    assert code == 2 and "not UTF-8" in out and "Traceback" not in out


def test_rollout_and_train_take_an_env_file(capsys, tmp_path):
    env_file = tmp_path / "my_env.py"
    env_file.write_text("import relax_gym\nfrom relax_gym.envs.procedural import ArithmeticEnv\n\n"
                        "class Mine(ArithmeticEnv):\n    pass\n\nrelax_gym.register('mine/Arith-v0', Mine)\n")
    code, out = run_cli(capsys, "rollout", "--env", str(env_file), "--model", str(WARM_START), "-n", "2",
                        "--max-new-tokens", "4", "--out", str(tmp_path / "t.jsonl"))
    assert code == 0, out
    assert "mine/Arith-v0" in out
    code, out = train_cli(capsys, tmp_path, f"envs=[{{id: {env_file}}}]", "trainer.total_steps=1")
    assert code == 0, out
    assert train_rows(tmp_path / "run")[0]["reward_per_env"].keys() == {"mine/Arith-v0"}


# --- runs that cannot learn stop ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_every_episode_failing_the_same_way_stops_the_run(capsys, tmp_path, flaky, mode):
    code, out = train_cli(capsys, tmp_path, f"envs=[{{id: '{flaky}:flaky/BreaksAfterFirstReset-v0'}}]",
                          f"trainer.mode={mode}", "trainer.total_steps=50")
    assert code == 1, out
    assert "failed the same way" in out and "the task server is gone" in out
    rows = train_rows(tmp_path / "run")
    assert len(rows) == 1 and rows[0]["trained_samples"] == 0  # the step is logged, then the run stops
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "1"


def test_no_trainable_sample_for_k_steps_stops_the_run(capsys, tmp_path, flaky):
    code, out = train_cli(capsys, tmp_path, f"envs=[{{id: '{flaky}:flaky/FailsVariously-v0'}}]",
                          "trainer.total_steps=50", "trainer.max_steps_without_samples=2")
    assert code == 1, out
    assert "no trainable sample for 2 steps in a row" in out
    assert "ValueError" in out and "KeyError" in out  # the breakdown names the reasons
    assert len(train_rows(tmp_path / "run")) == 2


def test_a_rollout_whose_every_episode_fails_exits_non_zero(capsys, tmp_path, flaky):
    out_file = tmp_path / "t.jsonl"
    code, out = run_cli(capsys, "rollout", "--env", f"{flaky}:flaky/BreaksAfterFirstReset-v0", "--model",
                        str(WARM_START), "-n", "3", "--max-new-tokens", "4", "--out", str(out_file))
    assert code == 1, out
    assert "3 episodes: 3 failed" in out and "the task server is gone" in out
    assert len(out_file.read_text().splitlines()) == 3  # the trajectories are kept


def test_an_eval_that_fails_is_logged_and_counted(capsys, tmp_path, flaky):
    code, out = train_cli(capsys, tmp_path, f"envs=[{{id: '{flaky}:flaky/FailsAtEval-v0'}}]",
                          "trainer.eval_every=1", "trainer.eval_tasks=2")
    assert code == 0, out
    evals = train_rows(tmp_path / "run", "eval")
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert all("no held-out split" in e["error"] for e in evals)
    assert "every episode failed" in out


# --- exact resume ------------------------------------------------------------------------------
def _trained_seeds(run: Path) -> dict[int, list[int]]:
    by_step: dict[int, set[int]] = {}
    for line in (run / "trajectories.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], set()).add(record["seed"])
    return {step: sorted(seeds) for step, seeds in sorted(by_step.items())}


def _config(run_dir: Path, *overrides: str):
    return load_config(None, [*BASE, ARITHMETIC, f"run_dir={run_dir}", "rollout.engine_max_batch_size=1",
                              *overrides])


def test_k0_resume_trains_the_same_tasks_and_numbers_as_an_uninterrupted_run(tmp_path):
    whole = tmp_path / "whole"
    train(_config(whole, "trainer.max_staleness=0", "trainer.total_steps=4"))
    split = tmp_path / "split"
    train(_config(split, "trainer.max_staleness=0", "trainer.total_steps=2"))
    summary = train(_config(split, "trainer.max_staleness=0", "trainer.total_steps=4"))
    assert summary["resumed_from"] == 2
    assert _trained_seeds(split) == _trained_seeds(whole)
    keys = ("step", "reward_mean", "train/loss", "trained_samples", "dropped_stale_total")
    assert [[r[k] for k in keys] for r in train_rows(split)] == [[r[k] for k in keys] for r in train_rows(whole)]
    assert train_rows(split)[-1]["dropped_stale_total"] == 0


def test_tasks_started_but_not_trained_are_played_first_after_a_resume(tmp_path):
    run = tmp_path / "run"
    train(_config(run, "trainer.max_staleness=2", "trainer.total_steps=3"))
    assert (run / "checkpoints" / "step_3").is_dir()
    train(_config(run, "trainer.max_staleness=2", "trainer.total_steps=6"))
    seeds = _trained_seeds(run)
    trained = [s for step in seeds.values() for s in step]
    assert len(trained) == len(set(trained))  # no task twice
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["dropped_stale_total"] == rows[-1]["filtered_total"] == 0  # admission control: none wasted
    assert sorted(trained) == list(range(min(trained), min(trained) + 12))  # and none skipped


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_good_one(capsys, tmp_path):
    run = tmp_path / "run"
    train(_config(run, "trainer.total_steps=3"))
    weights = run / "checkpoints" / "step_3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, as by a full disk
    summary = train(_config(run, "trainer.total_steps=4"))
    assert summary["resumed_from"] == 2
    assert [r["step"] for r in train_rows(run)] == [1, 2, 3, 4]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/reward_mean")]
    assert steps == [1, 2, 3, 4]  # the re-run step 3 is not there twice
    tags = events.Tags()["scalars"]
    assert "train/loss" in tags and not any(t.startswith("train/train/") for t in tags), tags


@pytest.mark.parametrize("damage", ["garbage pointer", "missing folder", "every checkpoint truncated"])
def test_damaged_checkpoints_are_skipped_or_named(capsys, tmp_path, damage):
    run = tmp_path / "run"
    train(_config(run, "trainer.total_steps=2"))
    checkpoints = run / "checkpoints"
    if damage == "garbage pointer":
        (checkpoints / "latest").write_bytes(b"\x00\xffgarbage")
    elif damage == "missing folder":
        (checkpoints / "latest").write_text("7")
    else:
        for state in checkpoints.glob("step_*/trainer_state.pt"):
            state.write_bytes(b"")
    code, out = train_cli(capsys, tmp_path, ARITHMETIC, "trainer.total_steps=3")
    if damage == "every checkpoint truncated":
        assert code == 2 and "no usable checkpoint" in out and "trainer_state.pt" in out, out
        assert "Traceback" not in out
        return
    assert code == 0, out
    assert "resuming" in out and "from step 2" in out
    assert [r["step"] for r in train_rows(run)] == [1, 2, 3]


def test_resume_never_refuses_a_folder_that_holds_a_run(capsys, tmp_path):
    train(_config(tmp_path / "run", "trainer.total_steps=1"))
    code, out = train_cli(capsys, tmp_path, ARITHMETIC, "trainer.resume=never")
    assert code == 2 and "holds a run" in out, out


def test_serve_on_a_device_this_machine_lacks_is_one_line(capsys):
    code, out = run_cli(capsys, "serve", "--device", "cuda:7")
    assert code == 2 and "relax-gym serve --device: 'cuda:7'" in out and "Traceback" not in out, out


def test_an_unreachable_engine_server_is_one_line_and_leaves_nothing(capsys, tmp_path):
    code, out = train_cli(capsys, tmp_path, ARITHMETIC, "rollout.engine=sglang",
                          "rollout.engine_url=http://127.0.0.1:9", "rollout.engine_outage_timeout_s=1")
    assert code == 2, out
    assert "127.0.0.1:9" in out and "Traceback" not in out
    assert not (tmp_path / "run").exists()


# --- engine outages ------------------------------------------------------------------------------
def _serve(port: int) -> subprocess.Popen:
    """`relax-gym serve` in its own process, waited for until /health answers."""
    proc = subprocess.Popen([sys.executable, "-m", "relax_gym.cli", "serve", "--model", str(WARM_START), "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("relax-gym serve did not come up")


@pytest.mark.timeout(600)
def test_an_engine_that_dies_stops_the_run_with_its_last_step_logged_then_it_resumes_on_a_paused_server(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(API_KEY_ENV, "test-key")  # the servers, the trainer subprocess and the client all read it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'run'}\nmodel: {WARM_START}\nenvs: [{{id: relax/Arithmetic-v0}}]\n"
                   f"rollout: {{engine: sglang, engine_url: 'http://127.0.0.1:{port}', engine_outage_timeout_s: 3,\n"
                   "  group_size: 2, groups_per_step: 2, max_new_tokens: 4, max_turns: 1}\n"
                   "trainer: {total_steps: 1000, checkpoint_every: 1000, lr: 1.0e-3}\n")
    server = _serve(port)
    trainer = subprocess.Popen([sys.executable, "-m", "relax_gym.cli", "train", str(cfg)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and trainer.poll() is None, trainer.stdout.read()
            time.sleep(0.2)
        server.kill()
        server.wait(30)
        out, _ = trainer.communicate(timeout=120)
    finally:
        server.kill()
        trainer.kill()
    assert trainer.returncode == 1, out
    assert "run stopped" in out and f"127.0.0.1:{port}" in out
    logged = [r["step"] for r in train_rows(tmp_path / "run")]
    latest = int((tmp_path / "run" / "checkpoints" / "latest").read_text())
    assert logged == list(range(1, latest + 1))  # every trained step is logged and checkpointed, none lost
    assert not (tmp_path / "run" / "weights").exists()  # a loopback server took them as shared tensors (auto)

    server = _serve(port)  # a fresh server, left paused as a killed trainer would leave it
    try:
        httpx.post(f"http://127.0.0.1:{port}/pause_generation", json={"mode": "in_place"}, timeout=10,
                   headers={"Authorization": "Bearer test-key"})
        summary = train(load_config(cfg, [f"trainer.total_steps={latest + 2}", "rollout.weight_sync=disk"]))
    finally:
        server.kill()
        server.wait(30)
    assert summary["resumed_from"] == latest
    assert [r["step"] for r in train_rows(tmp_path / "run")] == list(range(1, latest + 3))
    assert [p.name for p in (tmp_path / "run" / "weights").iterdir()] == [f"v{latest + 2}"]  # the older are pruned


def test_a_local_folder_named_like_a_tiny_model_is_not_shadowed(tmp_path, monkeypatch):
    save_model(load_model(str(WARM_START)), tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    folder = load_model("tiny").model.state_dict()  # the embedded tiny model has other (random) weights
    warm = load_model(str(WARM_START)).model.state_dict()
    assert all(torch.equal(folder[k], warm[k]) for k in warm)


def test_answers_cut_by_max_new_tokens_are_reported_as_ungraded(capsys, tmp_path):
    code, out = run_cli(capsys, "rollout", "--env", "relax/Arithmetic-v0", "--model", str(WARM_START), "-n", "4",
                        "--max-new-tokens", "1", "--out", str(tmp_path / "t.jsonl"))
    assert code == 0, out
    assert "hit --max-new-tokens before ending their turn, so they were not graded" in out
