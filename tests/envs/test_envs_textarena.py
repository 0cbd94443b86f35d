"""relax/TextArena-v0: a TextArena game by name, the policy in one seat, a scripted player in the others."""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys

import pytest

import relax_gym
from relax_gym.cli import main
from relax_gym.env.conformance import run_checks
from relax_gym.envs.textarena import candidate_moves

ENV_ID = "relax/TextArena-v0"
LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


def text(obs):
    return "\n".join(part["text"] for m in obs for part in m["content"])


def board(observation: str) -> list[str]:
    """The last TicTacToe board in a rendered observation: nine cells, 'O', 'X' or the free cell's number."""
    rows = re.findall(r"^ (\S) \| (\S) \| (\S) $", observation, re.MULTILINE)[-3:]
    return [cell for row in rows for cell in row]


def tictactoe_policy(observation: str, me: str) -> str:
    """Wins when it can, blocks when it must, else the centre, a corner, a side."""
    cells = board(observation)
    free = [i for i, c in enumerate(cells) if c.isdigit()]
    for who in (me, "X" if me == "O" else "O"):
        for line in LINES:
            marks = [cells[i] for i in line]
            if marks.count(who) == 2 and (gap := [i for i in line if cells[i].isdigit()]):
                return f"[{gap[0]}]"
    return f"[{next(i for i in (4, 0, 2, 6, 8, 1, 3, 5, 7) if i in free)}]"


def play(env, seed, policy):
    obs, _ = env.reset(seed=seed)
    seen, done, reward, info = [text(obs)], False, 0.0, {}
    while not done:
        obs, reward, terminated, truncated, info = env.step(policy(seen[-1]))
        seen.append(text(obs))
        done = terminated or truncated
    return seen, reward, info


def test_missing_package_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)  # makes `import textarena` fail
    with pytest.raises(ImportError, match=r"pip install 'relax-gym\[textarena\]'"):
        relax_gym.make(ENV_ID)


def test_listing_does_not_need_the_package():
    assert ENV_ID in relax_gym.list_envs()
    assert relax_gym.describe(ENV_ID)["description"].startswith("A TextArena game by id")


def test_candidate_moves_prefer_the_listed_ones():
    prompt = "For example, '[4]' places your mark."
    assert candidate_moves([prompt, "Board\n\nAvailable Moves: '[0]', '[8]'"]) == ["[0]", "[8]"]
    assert candidate_moves([prompt, "no listing here"]) == ["[4]"]
    assert candidate_moves(["nothing"]) == []


@pytest.fixture
def ta():
    return pytest.importorskip("textarena")


def test_make_by_id_picks_the_raw_variant(ta):
    env = relax_gym.make(ENV_ID, game="TicTacToe-v0")
    obs, info = env.reset(seed=0)
    assert info["made"] == "TicTacToe-v0-raw" and info["seat"] == 0 and env.num_players == 2
    assert "Tic Tac Toe" in text(obs) and "Available Moves" in text(obs)


def test_unknown_game_names_close_matches(ta):
    with pytest.raises(ValueError, match=r"TicTacToe-v0"):
        relax_gym.make(ENV_ID, game="TicTacToo-v0")


def test_bad_seat_and_opponent_are_refused(ta):
    with pytest.raises(ValueError, match="seat"):
        relax_gym.make(ENV_ID, seat=2)
    with pytest.raises(ValueError, match="opponent"):
        relax_gym.make(ENV_ID, opponent="minimax")


def test_same_seed_same_game_in_fresh_envs_played_in_turn(ta):
    """The other seat's moves and the game's own draws come from the seed, also when episodes interleave and
    something else moves Python's process-wide `random` in between."""
    first, second = relax_gym.make(ENV_ID), relax_gym.make(ENV_ID)
    outside = random.getstate()
    a, b = first.reset(seed=3), second.reset(seed=3)
    assert a == b and random.getstate() == outside  # the game's reseeding stays inside the env
    for move in ("[4]", "[0]", "[8]", "[2]", "[6]", "[1]"):
        random.random()
        ra, rb = first.step(move), second.step(move)
        assert ra == rb
        if ra[2] or ra[3]:
            break
    seen = {text(first.reset(seed=s)[0]) + text(first.step("[4]")[0]) for s in range(8)}
    assert len(seen) > 1  # seeds name different games (the opponent's replies differ)


def test_the_policy_seat_can_win_against_the_random_opponent(ta):
    env = relax_gym.make(ENV_ID, game="TicTacToe-v0", opponent="random")
    rewards = {}
    for seed in range(6):
        seen, rewards[seed], info = play(env, seed, lambda obs: tictactoe_policy(obs, "O"))
        assert info["rewards"][str(0)] == rewards[seed] and set(info["rewards"]) == {"0", "1"}
    assert max(rewards.values()) == 1.0, rewards
    won = next(s for s, r in rewards.items() if r == 1.0)
    seen, reward, info = play(env, won, lambda obs: tictactoe_policy(obs, "O"))  # the seed names the same game
    assert reward == 1.0 and info["reward"]["detail"] == "Player 0 has won!" and "Your reward: 1." in seen[-1]


def test_second_seat_sees_the_first_move(ta):
    env = relax_gym.make(ENV_ID, seat=1, opponent="first-legal")
    obs, _ = env.reset(seed=0)
    assert "[Player 0] [0]" in text(obs) and "placed their symbol (O) in cell 0" in text(obs)
    assert text(obs).count("Current Board") == 1  # the board before the first move is stale: dropped


def test_own_action_is_not_echoed(ta):
    env = relax_gym.make(ENV_ID)
    env.reset(seed=0)
    obs, *_ = env.step("[4] with a distinctive tail ZQX")
    shown = text(obs)
    assert "ZQX" not in shown and "placed their symbol (O) in cell 4" in shown
    assert "[Player 1] [" in shown  # the opponent's move is shown, with who made it


def test_invalid_move_gets_one_retry_then_loses(ta):
    env = relax_gym.make(ENV_ID)
    env.reset(seed=0)
    obs, reward, terminated, *_ = env.step("no move here")
    assert not terminated and "invalid move" in text(obs)
    obs, reward, terminated, _, info = env.step("still none")
    assert terminated and reward == -1.0 and info["rewards"] == {"0": -1.0, "1": 1.0}


def test_conformance_checks_pass(ta):
    report = run_checks(ENV_ID, lambda: relax_gym.make(ENV_ID, game="TicTacToe-v0"))
    assert report.passed, {r.name: r.detail for r in report.results if not r.passed}
    assert report.not_exercised == []


# KuhnPoker's deck outlives its reset (shuffled in place): one game object per episode keeps a seed's deal
@pytest.mark.parametrize("game", ["ConnectFour-v0", "KuhnPoker-v0"])
def test_cli_check_with_the_game_kwarg(ta, capsys, game):
    assert main(["check", ENV_ID, "--env-arg", f"game={game}", "--json"]) == 0, capsys.readouterr().out
    (report,) = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["not_exercised"] == []


def test_rollout_manager_plays_whole_games(ta):
    """Through the real rollout manager and chat template: the policy's replies are the moves, turn after turn."""
    from relax_gym.engines import ScriptedEngine
    from relax_gym.models import load_model
    from relax_gym.rollout import RolloutManager

    loaded = load_model("tiny")
    engine = ScriptedEngine(loaded, lambda turn: tictactoe_policy(turn.text, "O"))
    trajectories = asyncio.run(RolloutManager(engine, loaded).run(ENV_ID, n_tasks=4, seed=0))
    assert {t.status for t in trajectories} == {"completed"}
    assert all(len(t.infos) >= 3 for t in trajectories)  # whole games, several turns each
    assert [t.reward for t in trajectories] == [t.infos[-1]["reward"]["score"] for t in trajectories]
    assert 1.0 in [t.reward for t in trajectories]


def seat_policy(turn, mistakes: float = 0.0) -> str:
    """`tictactoe_policy` for whichever seat the conversation is (its prompt says), a random free cell with
    probability `mistakes` (seeded by the request's id, which names the game, the seat and the turn)."""
    me = "O" if "You are Player 0" in turn.text else "X"
    rng = random.Random(turn.request.rid)
    if rng.random() < mistakes:
        return f"[{rng.choice([i for i, c in enumerate(board(turn.text)) if c.isdigit()])}]"
    return tictactoe_policy(turn.text, me)


def test_self_play_plays_both_seats_of_one_game(ta):
    """opponent="self": each game gives one episode per seat, sharing the board, each with its seat's reward."""
    from relax_gym.engines import ScriptedEngine
    from relax_gym.models import load_model
    from relax_gym.rollout import RolloutManager

    loaded = load_model("tiny")
    manager = RolloutManager(ScriptedEngine(loaded, lambda turn: seat_policy(turn, mistakes=0.3)), loaded)
    trajectories = asyncio.run(manager.run_group("textarena/TicTacToe-v0", 1, 4, env_kwargs={"opponent": "self"}))
    assert [t.group_id[-6:] for t in trajectories] == ["@seat0", "@seat1"] * 4
    assert {t.status for t in trajectories} == {"completed"}
    for seat0, seat1 in zip(trajectories[0::2], trajectories[1::2], strict=True):
        assert seat0.reward + seat1.reward == 0  # a win and a loss, or a draw
        assert seat0.infos[-1]["seat_rewards"] == [seat0.reward, seat1.reward]
    assert {t.reward for t in trajectories} >= {1.0, -1.0}  # the mistakes decide some games
    second = loaded.tokenizer.decode(trajectories[1].token_ids)
    assert "You are Player 1" in second and "[Player 0]" in second  # seat 1 sees seat 0's moves


def test_self_play_trains_both_seats(ta, tmp_path):
    """A few train steps of the tiny model on both seats of TicTacToe: every seat's episodes are trained, each
    against its own seat's baseline. The moves come from a scripted engine (the random tiny model never ends a
    turn), the gradients from the real model."""
    from relax_gym.engines import ScriptedEngine
    from relax_gym.trainer.config import load_config
    from relax_gym.trainer.loop import Trainer

    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "model=tiny",
                             "envs=[{id: textarena/TicTacToe-v0, kwargs: {opponent: self}}]",
                             "rollout.group_size=4", "rollout.groups_per_step=2", "rollout.max_new_tokens=8",
                             "rollout.max_turns=6", "trainer.total_steps=2", "trainer.checkpoint_every=100"])
    trainer = Trainer(cfg)
    trainer.engine = trainer.manager.engine = ScriptedEngine(trainer.loaded, lambda t: seat_policy(t, 0.4))
    asyncio.run(trainer.run())
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["type"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["trained_samples"] > 0 for r in steps) and any(r["train/grad_norm"] > 0 for r in steps)
    trajectories = [json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajectories) == 2 * 2 * 4 * 2  # steps x groups x games x seats
    assert {t["group_id"][-6:] for t in trajectories} == {"@seat0", "@seat1"}
