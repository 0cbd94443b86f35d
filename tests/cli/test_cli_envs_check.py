"""`relax-gym envs` shows every id and description whole; `relax-gym check --env-arg` reaches the env."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import relax_gym
from relax_gym.cli import main
from relax_gym.messages import user

LONG_ID = "thirdparty/AVeryLongEnvironmentNameThatNeedsTheWidth-v0"

RANGE_ENV = textwrap.dedent(f'''
    import sys
    import relax_gym
    from relax_gym.cli import main

    class Range(relax_gym.Env):
        """Pick an integer in [low, high]; [bold]not bold[/bold] either."""

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return [relax_gym.messages.user("pick")], {{}}

        def step(self, action):
            return [], 0.0, True, False, {{}}

    relax_gym.register("{LONG_ID}", Range)
    sys.exit(main(["envs"]))
''')


@pytest.mark.parametrize("columns", [80, 40, 400])
def test_envs_shows_whole_ids_and_bracketed_descriptions(columns):
    env = {**os.environ, "COLUMNS": str(columns)}
    out = subprocess.run([sys.executable, "-c", RANGE_ENV], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(LONG_ID in line for line in lines), out.stdout  # whole, on one line, even wider than the console
    assert all(len(line) <= columns or line.strip() == LONG_ID for line in lines), out.stdout
    words = " ".join(out.stdout.split())  # a description may wrap; its text must all be there
    assert "[low, high]" in words and "[bold]not bold[/bold]" in words
    assert "relax/GuessNumber-v0" in out.stdout


class Sized(relax_gym.Env):
    """Says its size; a size that is not an int fails the checks."""

    def __init__(self, size: int = 1):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        self.size = size

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return [user(f"size {self.size}")], {}

    def step(self, action):
        return [user(f"size {self.size}")], 0.0, True, False, {}


def test_check_passes_yaml_typed_env_args_to_the_env(capsys):
    assert main(["check", "relax/Arithmetic-v0", "--env-arg", "digits=2", "--env-arg", "n_terms=3", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["passed"]
    assert main(["check", "relax/Arithmetic-v0", "--env-arg", "digits=0", "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert "got digits=0" in report["results"][0]["detail"]  # the value reached the constructor
    assert main(["check", f"{__file__}:Sized", "--env-arg", "size=3", "--json"]) == 0


@pytest.mark.parametrize(
    ("target", "pair", "needle"),
    [
        ("relax/Arithmetic-v0", "digts=2", "unexpected argument 'digts'. Did you mean 'digits'?"),
        (f"{__file__}:Sized", "sise=2", "unexpected argument 'sise'. Did you mean 'size'?"),
        ("relax/Arithmetic-v0", "digits", "bad --env-arg 'digits': expected key=value"),
        ("relax/Arithmetic-v0", "digits=[1,", "bad --env-arg 'digits=[1,'"),
    ],
)
def test_check_bad_env_arg_is_one_line_and_exit_2(capsys, target, pair, needle):
    assert main(["check", target, "--env-arg", pair]) == 2
    out = capsys.readouterr().out
    assert needle in out
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out



def test_check_of_an_env_that_needs_arguments_names_the_env_arg_to_pass(capsys):
    # relax/OpenEnv-v0 is made with the URL of an OpenEnv server; without it, one line says what to pass
    assert main(["check", "relax/OpenEnv-v0"]) == 1
    out = capsys.readouterr().out
    assert "construct: the env needs url: pass --env-arg url=VALUE" in out and "Traceback" not in out

# --- `relax-gym rollout` takes the training config's rollout section ----------------------------------------------
def test_rollout_takes_rollout_settings_after_its_flags(tmp_path, capsys):
    from relax_gym.trajectory import read_jsonl

    out = tmp_path / "t.jsonl"
    code = main(["rollout", "--env", "relax/Arithmetic-v0", "--model", "tiny", "-n", "2", "--out", str(out),
                 "--max-new-tokens", "9", "rollout.max_new_tokens=3", "rollout.group_size=2", "rollout.temperature=0"])
    assert code == 0, capsys.readouterr().out
    trajs = list(read_jsonl(out))
    assert len(trajs) == 4 and max(t.num_generated for t in trajs) <= 3  # the setting won over its flag
    for first, second in (trajs[:2], trajs[2:]):  # greedy: a group's members are the same episode
        assert first.group_id == second.group_id and first.token_ids == second.token_ids


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["rollout.max_turnz=2"], "unknown key 'rollout.max_turnz'. Did you mean 'rollout.max_turns'?"),
        (["--max-turns", "0"], "rollout.max_turns: Input should be greater than or equal to 1"),
        (["trainer.lr=1"], "relax-gym rollout takes rollout.KEY=VALUE settings"),
        (["rollout.groups_per_step=2"], "relax-gym rollout plays -n tasks"),
    ],
)
def test_rollout_bad_settings_stop_it_before_it_starts(tmp_path, capsys, args, needle):
    assert main(["rollout", "--env", "relax/Arithmetic-v0", "--out", str(tmp_path / "t.jsonl"), *args]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert needle in out and "Traceback" not in out
    assert not (tmp_path / "t.jsonl").exists()
