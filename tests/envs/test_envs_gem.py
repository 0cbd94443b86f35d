"""relax/GEM-v0: any GEM env by its GEM id, against the real gem-llm package (the `gem` extra)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import relax_gym
from relax_gym.cli import main
from relax_gym.env.conformance import run_checks

ENV_ID = "relax/GEM-v0"
EASY, HARD = "game:GuessTheNumber-v0-easy", "game:GuessTheNumber-v0-hard"
FEEDBACK = re.compile(r"you guessed (\d+), and the target number is (higher|lower)")


def test_missing_package_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "gem", None)  # makes `import gem` fail
    with pytest.raises(ImportError, match=r"pip install 'relax-gym\[gem\]'"):
        relax_gym.make(ENV_ID)


def test_listing_does_not_need_the_package():
    assert ENV_ID in relax_gym.list_envs()
    assert relax_gym.describe(ENV_ID)["description"].startswith("A GEM env by id")


@pytest.fixture
def gem():
    return pytest.importorskip("gem")  # CI installs the `gem` extra (scripts/test.sh), so there these all run


def text(messages: list[dict[str, Any]]) -> str:
    return "".join(p["text"] for m in messages for p in m["content"] if p["type"] == "text")


def bisect(env: Any, low: int, high: int) -> tuple[list[float], dict[str, Any]]:
    """Plays GuessTheNumber by binary search on the feedback the env's observations give."""
    rewards = []
    while True:
        guess = (low + high) // 2
        obs, reward, terminated, truncated, info = env.step(f"My guess is \\boxed{{{guess}}}.")
        rewards.append(reward)
        if terminated or truncated:
            return rewards, info
        said, direction = FEEDBACK.search(text(obs)).groups()
        assert int(said) == guess
        low, high = (guess + 1, high) if direction == "higher" else (low, guess - 1)


@pytest.mark.parametrize(("gem_id", "high"), [(EASY, 10), (HARD, 50)])
def test_binary_search_wins_every_seed(gem, gem_id, high):
    env = relax_gym.make(ENV_ID, gem_id=gem_id)
    for seed in range(12):
        obs, info = env.reset(seed=seed)
        assert f"between 1 and {high}" in text(obs) and info["gem_seed"] == seed
        rewards, info = bisect(env, 1, high)
        assert rewards[-1] == 1.0 and sum(rewards) == 1.0, (seed, rewards)
        assert info["gem_id"] == gem_id and info["turn"] == len(rewards)


def test_kwargs_go_to_gem_make(gem):
    obs, _ = relax_gym.make(ENV_ID, gem_id=HARD, max_turns=3).reset(seed=0)
    assert "within 3 turns" in text(obs)


def play(env: Any, seed: int, actions: list[str]) -> list[tuple]:
    obs, _ = env.reset(seed=seed)
    out: list[tuple] = [text(obs)]
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(action)
        out.append((text(obs), reward, terminated, truncated))
        if terminated or truncated:
            break
    return out


def test_the_seed_names_the_task(gem):
    guesses = [f"\\boxed{{{g}}}" for g in (25, 12, 37, 6)]
    runs = {seed: play(relax_gym.make(ENV_ID, gem_id=HARD), seed, guesses) for seed in range(6)}
    assert runs == {seed: play(relax_gym.make(ENV_ID, gem_id=HARD), seed, guesses) for seed in range(6)}
    assert len({json.dumps(r) for r in runs.values()}) > 3  # the hidden number differs between seeds


def test_game_randomness_per_step_is_the_episodes_own(gem):
    """2048 draws a new tile from the process-wide RNGs on every move: envs stepping in threads, interleaved, still
    replay their seed exactly, and the process's own RNG does not move."""
    import random

    moves = ["\\boxed{up}", "\\boxed{left}", "\\boxed{down}", "\\boxed{right}"] * 3
    alone = [play(relax_gym.make(ENV_ID, gem_id="game:Game2048-v0-easy"), seed, moves) for seed in range(8)]
    random.seed(1)
    expected = random.random()
    random.seed(1)
    with ThreadPoolExecutor(8) as pool:
        threaded = list(pool.map(lambda s: play(relax_gym.make(ENV_ID, gem_id="game:Game2048-v0-easy"), s, moves),
                                 range(8)))
    assert threaded == alone and len({json.dumps(r) for r in alone}) == 8
    assert random.random() == expected


def test_unknown_id_names_close_matches(gem):
    with pytest.raises(ValueError, match=r"^GEM has no env 'game:GuessTheNumber-easy'; close matches: "
                                         r"game:GuessTheNumber-v0-easy") as err:
        relax_gym.make(ENV_ID, gem_id="game:GuessTheNumber-easy")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("gem_id", [EASY, "game:Game2048-v0-easy", "rg:leg_counting"])
def test_conformance(gem, gem_id):
    report = run_checks(gem_id, lambda: relax_gym.make(ENV_ID, gem_id=gem_id))
    assert report.passed and not report.not_exercised, report.to_dict()


def test_cli_check_with_env_args(gem, capsys):
    assert main(["check", ENV_ID, "--env-arg", f"gem_id={HARD}", "--env-arg", "max_turns=5", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["target"] == ENV_ID


def test_import_leaves_the_root_logger_and_the_process_rngs_alone(gem):
    """`import gem` calls logging.basicConfig(level=INFO), and its imports draw from `random`: a fresh process."""
    code = textwrap.dedent("""
        import logging, random
        import numpy as np
        import relax_gym
        root = logging.getLogger()
        root.setLevel(logging.ERROR)
        before = root.level, list(root.handlers)
        random.seed(3); np.random.seed(3)
        relax_gym.make("relax/GEM-v0").reset(seed=1)
        import sys; assert "gem" in sys.modules
        assert (root.level, list(root.handlers)) == before, (root.level, root.handlers)
        a, b = random.random(), np.random.random()
        random.seed(3); np.random.seed(3)
        assert (a, b) == (random.random(), np.random.random())
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_rollout_with_a_scripted_bisecting_player(gem):
    """The whole path: the rollout manager, the tiny model's chat template and tokens, a player reading feedback."""
    from relax_gym.engines import ScriptedEngine, ScriptedTurn
    from relax_gym.models import load_model
    from relax_gym.rollout import RolloutManager

    def reply(turn: ScriptedTurn) -> str:
        low, high = 1, 10
        for guess, direction in FEEDBACK.findall(turn.text):
            low, high = (int(guess) + 1, high) if direction == "higher" else (low, int(guess) - 1)
        return f"\\boxed{{{(low + high) // 2}}}"

    loaded = load_model("tiny")
    trajs = asyncio.run(RolloutManager(ScriptedEngine(loaded, reply), loaded).run(ENV_ID, n_tasks=4, seed=0))
    assert [(t.status, t.reward) for t in trajs] == [("completed", 1.0)] * 4
