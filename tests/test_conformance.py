"""The checker passes good envs and names what is wrong with bad ones."""

import json
import random
from pathlib import Path

import pytest
from PIL import Image

from relax_gym import Env
from relax_gym.cli import main
from relax_gym.conformance import run_checks
from relax_gym.envs import BUNDLED
from relax_gym.messages import image, user

ROOT = Path(__file__).resolve().parents[1]


class GoodEnv(Env):
    """Counts turns; ends after three."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.n = int(self.np_random.integers(100))
        self.turn = 0
        return [user(f"number {self.n}")], {"n": self.n}

    def step(self, action):
        self.turn += 1
        done = self.turn >= 3
        return [user(f"turn {self.turn}")], float(done), done, False, {"turn": self.turn}

    def get_state(self):
        return {"n": self.n, "turn": self.turn}

    def set_state(self, state):
        self.n, self.turn = state["n"], state["turn"]


class UnseededEnv(GoodEnv):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.turn = 0
        return [user(str(random.random()))], {}


class CrashingEnv(GoodEnv):
    def step(self, action):
        if "<" in action or not action:
            raise ValueError("cannot handle that")
        return super().step(action)


class UndeclaredImageEnv(GoodEnv):
    def step(self, action):
        _, *rest = super().step(action)
        return [user(image(Image.new("RGB", (4, 4))))], *rest


class SetInfoEnv(GoodEnv):
    def step(self, action):
        obs, r, t, tr, _ = super().step(action)
        return obs, r, t, tr, {"seen": {1, 2}}


class LossyStateEnv(GoodEnv):
    def set_state(self, state):
        self.n = state["n"]  # forgets the turn counter


def failed(report):
    return {r.name: r.detail for r in report.results if not r.passed}


def test_good_env_passes_every_check():
    report = run_checks("good", GoodEnv)
    assert report.passed, failed(report)
    assert report.results[0].name == "gymnasium.check_env"


@pytest.mark.parametrize(
    ("cls", "check", "needle"),
    [
        (UnseededEnv, "reset is deterministic per seed", "different observations"),
        (CrashingEnv, "random actions never crash", "raised ValueError: cannot handle that"),
        (UndeclaredImageEnv, "declared modalities match", "['image']"),
        (SetInfoEnv, "random actions never crash", "not JSON-serialisable"),
        (LossyStateEnv, "state round trip", "differs"),
    ],
)
def test_bad_envs_fail_with_the_reason(cls, check, needle):
    report = run_checks(cls.__name__, cls)
    assert not report.passed
    assert needle in failed(report)[check]


def test_cli_check_exit_codes_and_json(capsys):
    assert main(["check", f"{__file__}:GoodEnv", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["passed"] is True
    assert main(["check", f"{__file__}:CrashingEnv"]) == 1
    assert main(["check", "relax/NoSuchEnv-v0"]) == 2


def test_cli_checks_the_custom_env_example(capsys):
    assert main(["check", str(ROOT / "examples/custom_env.py"), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["target"] == "example/Shopping-v0"


@pytest.mark.parametrize("env_id", sorted(BUNDLED))
def test_every_bundled_env_passes_relax_gym_check(capsys, env_id):
    if env_id == "relax/ReasoningGym-v0":
        pytest.importorskip("reasoning_gym")
    assert main(["check", env_id, "--json"]) == 0, capsys.readouterr().out
    (report,) = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["target"] == env_id
