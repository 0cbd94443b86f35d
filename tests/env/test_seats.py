"""Self-play: a `SeatedGame` played by the rollout manager as one episode per seat, through real chat templates."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import numpy as np
import pytest
import torch

import relax_gym
from relax_gym.engines import ScriptedEngine
from relax_gym.env.seats import SeatedGame
from relax_gym.messages import message
from relax_gym.models import load_model
from relax_gym.rollout import RolloutManager
from relax_gym.trainer.loop import group_to_samples

ENV_ID = "test/Nim-v0"


class Nim(SeatedGame):
    """Two seats take 1 or 2 from a pile in turn; whoever takes the last wins (+1, the other -1). The seed sets
    the pile. `bad_move="raise"` makes an unreadable move raise instead of costing the game."""

    blocking = False

    def __init__(self, bad_move: str = "lose"):
        self.policy_seats = 2
        self.bad_move = bad_move
        self.pile, self.turn, self.winner = 0, 0, None
        self.news: dict[int, list[str]] = {}

    def reset_game(self, seed: int | None, options: dict[str, Any] | None) -> None:
        self.pile, self.turn, self.winner = (seed or 0) % 7 + 1, 0, None
        self.news = {0: [f"You are seat 0. Pile: {self.pile}."], 1: [f"You are seat 1. Pile: {self.pile}."]}

    def seat_to_move(self) -> int | None:
        return None if self.winner is not None else self.turn % 2

    def observe(self, seat: int) -> list[Any]:
        news, self.news[seat] = self.news[seat], []
        return [message("user", " ".join(news))]

    def act(self, action: str) -> None:
        seat = self.turn % 2
        took = int(action) if action.strip() in ("1", "2") else None
        if took is None and self.bad_move == "raise":
            raise ValueError(f"seat {seat} wrote {action!r}")
        if took is None or took > self.pile:
            self.winner = 1 - seat
            return
        self.pile -= took
        self.turn += 1
        if self.pile == 0:
            self.winner = seat
        self.news[1 - seat].append(f"Seat {seat} took {took}. Pile: {self.pile}.")

    def seat_rewards(self) -> list[float]:
        return [1.0 if seat == self.winner else -1.0 for seat in range(2)]

    def scripted_actions(self) -> list[str]:
        return ["1"]


relax_gym.register(ENV_ID, Nim)


def optimal(turn: Any) -> str:
    """Leaves a multiple of 3 when it can; the pile is the last one the conversation mentions."""
    pile = int(re.findall(r"Pile: (\d+)", turn.text)[-1])
    return str(pile % 3 or 1)


@pytest.fixture(scope="module")
def loaded():
    return load_model("tiny")


def run(loaded: Any, reply: Any, *, seed: int, group_size: int = 2, concurrency: int = 64,
        max_new_tokens: int = 32, **kwargs: Any) -> list[Any]:
    engine = ScriptedEngine(loaded, reply)
    manager = RolloutManager(engine, loaded, max_concurrency=concurrency,
                             sampling=relax_gym.engines.SamplingParams(max_new_tokens=max_new_tokens))
    return asyncio.run(manager.run_group(ENV_ID, seed, group_size, env_kwargs=kwargs))


def test_each_seat_is_an_episode_with_its_own_group_and_reward(loaded):
    trajectories = run(loaded, optimal, seed=4)  # a pile of 5: seat 0 takes 2, then mirrors seat 1
    assert [t.group_id for t in trajectories] == [f"{ENV_ID}#4@seat{s}" for s in (0, 1, 0, 1)]
    assert {t.status for t in trajectories} == {"completed"}
    assert [t.reward for t in trajectories] == [1.0, -1.0, 1.0, -1.0]
    assert trajectories[0].infos[-1]["seat_rewards"] == [1.0, -1.0]
    seat1 = loaded.tokenizer.decode(trajectories[1].token_ids)
    assert "Seat 0 took 2. Pile: 3." in seat1  # its first turn shows the first move
    assert "Seat 1 took" not in seat1  # its own moves are its replies, not news
    for t in trajectories:  # the seat's replies, and only those, are trained
        replies = [tok for tok, trained in zip(t.token_ids, t.loss_mask, strict=True) if trained]
        assert re.fullmatch(r"(\d<\|im_end\|>)+", loaded.tokenizer.decode(replies))


def test_advantages_are_relative_to_the_same_seat(loaded):
    """Seat 0 wins one game and loses the other: its baseline is its own mean (0), not the other seat's."""
    replies = iter(["2", "1", "1", "1", "1", "1"])  # game 0: 2, 1, 1, 1 ... by arrival order
    trajectories = run(loaded, lambda turn: next(replies, "1"), seed=2, group_size=2)  # pile 3
    rewards = [t.reward for t in trajectories]
    assert sorted(rewards[0::2]) == [-1.0, 1.0] and sorted(rewards[1::2]) == [-1.0, 1.0]
    samples = group_to_samples(trajectories, std_normalize=False)
    assert [s.advantage for s in samples] == rewards  # each seat's mean is 0
    uniform = run(loaded, optimal, seed=2)
    advantages = torch.tensor([s.advantage for s in group_to_samples(uniform, std_normalize=False)])
    assert torch.equal(advantages, torch.zeros(4))  # every game the same: no signal for either seat


def test_a_seat_that_leaves_ends_the_game_for_the_others(loaded):
    """Seat 1's reply runs past max_new_tokens: it is truncated, and seat 0, waiting for its turn, too."""
    def reply(turn: Any) -> str:
        return "1" if "You are seat 0" in turn.text else "a very long answer " * 20

    trajectories = run(loaded, reply, seed=5, group_size=1, max_new_tokens=8)
    assert [t.status for t in trajectories] == ["truncated", "truncated"]
    assert trajectories[1].status_reason == "max_new_tokens"
    assert trajectories[0].status_reason.startswith("seat 1 left")
    assert [t.reward for t in trajectories] == [0.0, 0.0]


def test_a_move_that_raises_fails_that_seat_and_truncates_the_other(loaded):
    trajectories = run(loaded, lambda turn: "x" if "You are seat 1" in turn.text else "1", seed=5, group_size=1,
                       bad_move="raise")
    assert [t.status for t in trajectories] == ["truncated", "failed"]
    assert "wrote 'x'" in trajectories[1].status_reason


def test_a_game_over_before_a_seat_moves_truncates_that_seat_without_a_reply(loaded):
    trajectories = run(loaded, lambda turn: "1", seed=0, group_size=1)  # a pile of 1: seat 0 takes it
    assert [t.status for t in trajectories] == ["completed", "truncated"]
    assert trajectories[1].num_generated == 0
    assert trajectories[0].reward == 1.0
    assert "ended before seat 1 moved" in trajectories[1].status_reason


def test_games_take_all_their_seats_slots_at_once(loaded):
    """Four games on two slots: a game never holds one slot while its other seat waits for a second."""
    trajectories = run(loaded, optimal, seed=4, group_size=4, concurrency=2)
    assert [t.status for t in trajectories] == ["completed"] * 8
    with pytest.raises(ValueError, match="concurrency >= 2"):
        run(loaded, optimal, seed=4, group_size=1, concurrency=1)


class ShuffledNim(Nim):
    """Ignores its seed: a group's games would start from different piles."""

    def reset_game(self, seed: int | None, options: dict[str, Any] | None) -> None:
        super().reset_game(None, options)
        self.pile = int(np.random.default_rng().integers(3, 30))
        self.news = {seat: [f"You are seat {seat}. Pile: {self.pile}."] for seat in (0, 1)}


def test_the_checker_plays_a_game_through_its_seats_and_catches_an_ignored_seed():
    from relax_gym.env.conformance import run_checks

    report = run_checks("nim", Nim)
    assert report.passed, report.results
    assert [r.name for r in report.results] == ["self-play game plays through its seats",
                                                "seeded replay in fresh games"]
    failed = {r.name: r.detail for r in run_checks("shuffled", ShuffledNim).results if r.status == "failed"}
    assert "the seed does not name the game" in failed["seeded replay in fresh games"]
