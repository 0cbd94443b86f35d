"""Any TextArena game (https://github.com/LeonGuertler/TextArena) by name, the policy in one seat.

TextArena has ~100 text games (board games, card games, negotiation) with
their own rules, legality checks and end-of-game rewards; wrapping it by name
gives all of them. The policy plays one seat and a scripted player moves for the
others between its turns, or, with `opponent="self"`, the policy plays every
seat, each its own episode (a `SeatedGame`: relax_gym.env.seats). It is an
optional extra (`textarena`), imported when the env is made, not when the id is
listed.

TextArena seeds Python's process-wide `random` at reset and some games draw
from it while they are played (a shuffled deck, a dealt card). Each env
therefore keeps its own copy of that state and swaps it in, under one
module-wide lock, for every call into the game, so interleaved episodes (a
GRPO group, the rollout manager's threads) never move each other's games.
"""

from __future__ import annotations

import difflib
import random
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np

from relax_gym.env.core import Env, EpisodeState, StepResult
from relax_gym.env.env_wire import plain
from relax_gym.env.seats import SeatedGame
from relax_gym.env.spaces import MessageSpace
from relax_gym.messages import Message, message
from relax_gym.rewards import RewardResult

INSTALL_HINT = "pip install 'relax-gym[textarena]'"
OPPONENTS = ("random", "first-legal", "self")
MAX_OTHER_MOVES = 1000  # moves the other seats may make between two policy turns before the game counts as stalled

#: Python's `random` is one per process and TextArena's games use it; held while a game's copy of it is swapped in
_RANDOM_LOCK = threading.Lock()

#: one TextArena observation message: (sender seat, or -1 for the game; text; ObservationType)
TAMessage = tuple[int, str, Any]
#: a player for a seat: (seat, that seat's new observation messages) -> its action
Player = Callable[[int, list[TAMessage]], str]

_LISTING = re.compile(r"\b(available|valid|legal|possible)\s+(moves|actions)\b", re.IGNORECASE)
_BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")


def import_textarena() -> ModuleType:
    try:
        import textarena
    except ImportError as err:
        raise ImportError(f"relax/TextArena-v0 needs the textarena package: {INSTALL_HINT}") from err
    return textarena


def make_game(ta: ModuleType, game: str) -> tuple[Any, str]:
    """The game without TextArena's wrappers (they restate the whole history each turn and rewrite actions), and
    the id made: `game`'s `-raw` variant when registered, else `game` itself, unwrapped."""
    registry = ta.envs.registration.ENV_REGISTRY
    if game not in registry:
        names = [n for n in registry if not n.endswith(("-raw", "-train"))]
        close = difflib.get_close_matches(game, names, n=5, cutoff=0.5)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"TextArena has no game {game!r}.{hint} ({len(names)} games, e.g. 'TicTacToe-v0')")
    made = f"{game}-raw" if f"{game}-raw" in registry else game
    try:
        env = ta.make(made)
    except SyntaxError as err:  # textarena 0.7.4's Chess and Checkers use Python 3.12 f-strings
        raise ImportError(f"TextArena's {game} does not import on this Python: {err}") from err
    while isinstance(env, ta.Wrapper):
        env = env.env
    return env, made


def candidate_moves(texts: Iterable[str]) -> list[str]:
    """Moves the game lists ("Available Moves: '[0]', '[4]'") on the latest line that lists some; else every
    bracketed token the texts mention (a rules prompt's examples, like "'[4]' places your mark"), in order."""
    texts = list(texts)
    for text in reversed(texts):
        for line in reversed(text.splitlines()):
            if _LISTING.search(line) and (listed := _BRACKETED.findall(line)):
                return list(dict.fromkeys(listed))
    return list(dict.fromkeys(t for text in texts for t in _BRACKETED.findall(text)))


class ScriptedPlayer:
    """The other seats: a move the game's messages list, random (`"random"`, from `rng` so the seed names the game)
    or the first (`"first-legal"`). A seat whose new messages list none reuses what it last saw listed (its
    prompt's examples at first), else sends "[0]". Other players' actions are never read: they are not the rules."""

    def __init__(self, strategy: str, rng: np.random.Generator):
        self.strategy, self.rng = strategy, rng
        self.known: dict[int, list[str]] = {}

    def __call__(self, seat: int, observation: list[TAMessage]) -> str:
        moves = candidate_moves(text for sender, text, _ in observation if sender < 0) or self.known.get(seat, [])
        self.known[seat] = moves
        if not moves:
            return "[0]"
        return moves[0] if self.strategy == "first-legal" else moves[int(self.rng.integers(len(moves)))]


class StalledGame(RuntimeError):
    """The other seats moved MAX_OTHER_MOVES times without the game ending or reaching a policy seat."""


def play_turns(game: Any, players: Mapping[int, Player], max_moves: int = MAX_OTHER_MOVES) -> int | None:
    """Lets `players` move for their seats until a seat without one is to move, and returns that seat (None once
    the game is over). Seats missing from `players` are policies': self-play passes {} and gives each returned
    seat's turn to that seat's conversation."""
    for _ in range(max_moves):
        if game.state.done:
            return None
        seat = int(game.state.current_player_id)
        if seat not in players:
            return seat
        _, observation = game.get_observation()
        game.step(players[seat](seat, observation))
    raise StalledGame(f"the other seats made {max_moves} moves without the game ending or the policy's turn coming")


def render(seat: int, observation: list[TAMessage], names: Mapping[int, str]) -> str:
    """A seat's new messages as one text: its own action's echo dropped (the model wrote it), only the latest
    board kept (an earlier one in the same batch is stale), other seats' actions marked with their role's name."""
    ta = import_textarena()
    boards = [i for i, (_, _, kind) in enumerate(observation) if kind == ta.ObservationType.GAME_BOARD]
    lines = []
    for i, (sender, text, kind) in enumerate(observation):
        if (kind == ta.ObservationType.PLAYER_ACTION and sender == seat) or (boards and i in boards[:-1]):
            continue
        lines.append(text.strip() if sender == ta.GAME_ID else f"[{names.get(sender, sender)}] {text.strip()}")
    return "\n\n".join(line for line in lines if line)


class TextArenaEnv(EpisodeState, SeatedGame):
    """A TextArena game by id, the policy in seat `seat`, the other seats played by `opponent` ("self": the policy
    in every seat, each seat its own episode).

    Each turn's observation is what the game told the seat since its last
    move; the reply is the move. The reward is the seat's end-of-game reward
    from TextArena (+1 win, -1 loss or a second invalid move, 0 draw in
    two-player games); every seat's is in the last `info`.
    """

    metadata: dict[str, Any] = {**Env.metadata, "modalities": ("text",)}  # noqa: RUF012 (see Env.metadata)

    def __init__(self, game: str = "TicTacToe-v0", seat: int = 0, opponent: str = "random",
                 num_players: int | None = None):
        """`num_players=None` takes the first of 2, 1, 3, 4 the game accepts."""
        ta = import_textarena()
        if opponent not in OPPONENTS:
            raise ValueError(f"opponent must be one of {OPPONENTS}, got {opponent!r}")
        self.game_id, self.seat, self.opponent = game, seat, opponent
        self._game, self.made_id = make_game(ta, game)
        self._random: tuple[Any, ...] | None = None
        self._player = ScriptedPlayer(opponent, np.random.default_rng(0))  # replaced with the game's at each reset
        self.num_players = self._accepted_players(num_players)
        if not 0 <= seat < self.num_players:
            raise ValueError(f"seat must be in [0, {self.num_players}) for {game} with {self.num_players} players")
        self.policy_seats = self.num_players if opponent == "self" else 1
        self.observation_space = MessageSpace(modalities=self.metadata["modalities"])
        self.episode: dict[str, Any] = {}

    def _accepted_players(self, wanted: int | None) -> int:
        """The player count, checked by a reset (TextArena's states assert it) so a wrong one fails at make time."""
        errors = []
        for n in (2, 1, 3, 4) if wanted is None else (wanted,):
            try:
                with self._own_random():
                    self._game.reset(num_players=n, seed=0)
                return n
            except (AssertionError, ValueError) as err:
                errors.append(f"{n}: {err or type(err).__name__}")
        raise ValueError(f"TextArena game {self.game_id!r} refused the player count ({'; '.join(errors)})")

    @contextmanager
    def _own_random(self) -> Iterator[None]:
        """Runs game code on this env's copy of Python's `random`, leaving the process's own untouched."""
        with _RANDOM_LOCK:
            outside = random.getstate()
            if self._random is not None:
                random.setstate(self._random)
            try:
                yield
            finally:
                self._random = random.getstate()
                random.setstate(outside)

    def _others(self) -> dict[int, Player]:
        """The scripted seats: none in self-play."""
        if self.policy_seats > 1:
            return {}
        return {s: self._player for s in range(self.num_players) if s != self.seat}

    def _start(self, game_seed: int) -> tuple[tuple[str, list[str]], int | None]:
        """Resets the game and plays the other seats up to the policy's first turn: (its observation, who moves)."""
        self._player = ScriptedPlayer(self.opponent, np.random.default_rng(game_seed))
        self._game, _ = make_game(import_textarena(), self.game_id)  # fresh: some games keep state across resets
        with self._own_random():
            self._game.reset(num_players=self.num_players, seed=game_seed)
            to_move = play_turns(self._game, self._others())
            return self._observe(self.seat, to_move), to_move

    def _move(self, to_move: int | None, action: str) -> int | None:
        """Plays the policy's action, then the other seats; returns who moves next. Call under `_own_random`."""
        if to_move == self.seat:
            self._game.step(action)
        return play_turns(self._game, self._others())

    def _observe(self, seat: int, to_move: int | None) -> tuple[str, list[str]]:
        """`seat`'s new messages rendered, and the moves the game listed in them. TextArena hands them over only to
        the seat to move, so another seat's (and any at the end) are read from its state."""
        if to_move == seat:
            _, observation = self._game.get_observation()
        else:
            observation, self._game.state.observations[seat] = self._game.state.observations[seat], []
        names = getattr(self._game.state, "role_mapping", None) or {}
        moves = candidate_moves(text for sender, text, _ in observation if sender < 0)
        return render(seat, observation, names), moves

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if self.policy_seats > 1:
            raise TypeError('with opponent="self" every seat is an episode: the rollout manager plays the game '
                            "through its seats (relax_gym.env.seats), not through reset and step")
        super().reset(seed=seed)
        game_seed = int(self.np_random.integers(2**31))  # named by `seed`; a new game on each unseeded reset
        (text, moves), to_move = self._start(game_seed)
        self.episode = {"game_seed": game_seed, "actions": [], "turn": 0, "to_move": to_move, "done": False,
                        "moves": moves}
        return [message("user", text)], {**self.task_info(), "turn": 0}

    def step(self, action: str) -> StepResult:
        ep = self.running_episode()
        ep["actions"].append(action)
        ep["turn"] += 1
        info: dict[str, Any] = {**self.task_info(), "turn": ep["turn"]}
        with self._own_random():
            try:
                ep["to_move"] = self._move(ep["to_move"], action)
            except StalledGame as err:
                ep["done"] = True
                result = RewardResult(0.0, detail=str(err))
                return [], 0.0, False, True, {**info, "truncated_by": "stalled", "reward": result.to_info()}
            text, ep["moves"] = self._observe(self.seat, ep["to_move"])
            ended = self._game.close() if ep["to_move"] is None else None
        if ended is None:
            return [message("user", text)], 0.0, False, False, info
        ep["done"] = True
        scores, game_info = ended
        rewards = {int(s): float(r) for s, r in (scores or {}).items()}
        mine = (game_info or {}).get(self.seat, {})
        reward = rewards.get(self.seat, 0.0)
        reason = str(mine.get("reason", "")) or None
        result = RewardResult(reward, detail=reason)
        info |= {"rewards": {str(s): r for s, r in rewards.items()}, "game_info": plain(game_info),
                 "reward": result.to_info()}
        ending = f"The game is over. {reason or ''} Your reward: {reward:g}.".replace("  ", " ")
        return [message("user", f"{text}\n\n{ending}" if text else ending)], reward, True, False, info

    def task_info(self) -> dict[str, Any]:
        """Facts added to every step's `info`, so trajectories can be grouped by game and seat."""
        return {"game": self.game_id, "made": self.made_id, "seat": self.seat, "opponent": self.opponent,
                "game_seed": self.episode.get("game_seed")}

    def set_state(self, state: dict[str, Any]) -> None:
        """Rebuilds the game by replaying the snapshot's actions on its seed: the game and the scripted players are
        a function of those, and TextArena's objects need not be copyable."""
        super().set_state(state)
        ep = self.episode
        if not ep:
            return
        _, to_move = self._start(ep["game_seed"])
        with self._own_random():
            for action in ep["actions"]:
                try:
                    to_move = self._move(to_move, action)
                except StalledGame:  # the episode ended there, truncated
                    return
                self._observe(self.seat, to_move)

    def scripted_actions(self) -> list[str]:
        """The `ScriptedEnv` hook (`relax-gym check`, benchmarks/env_step.py): the moves the game listed to the
        policy at this point, in order (later ones may have become illegal; a game allows one retry)."""
        return list(self.episode.get("moves") or ["[0]"])[:8]

    # --- self-play (`opponent="self"`): the `SeatedGame` methods, each seat an episode of its own ---------------
    def reset_game(self, seed: int | None, options: dict[str, Any] | None) -> None:
        super().reset(seed=seed)
        game_seed = int(self.np_random.integers(2**31))
        self._game, _ = make_game(import_textarena(), self.game_id)
        with self._own_random():
            self._game.reset(num_players=self.num_players, seed=game_seed)
            to_move = play_turns(self._game, {})
        self.episode = {"game_seed": game_seed, "to_move": to_move, "done": to_move is None, "rewards": None}

    def seat_to_move(self) -> int | None:
        return None if self.episode["done"] else self.episode["to_move"]

    def observe(self, seat: int) -> list[Message]:
        text, self.episode["moves"] = self._observe(seat, self.episode["to_move"])
        return [message("user", text)]

    def act(self, action: str) -> None:
        ep = self.running_episode()
        with self._own_random():
            self._game.step(action)
            ep["to_move"] = play_turns(self._game, {})
            if ep["to_move"] is None:
                scores, _ = self._game.close()
                ep["rewards"] = {int(s): float(r) for s, r in (scores or {}).items()}
                ep["done"] = True

    def seat_rewards(self) -> list[float]:
        rewards = self.episode.get("rewards") or {}
        return [rewards.get(seat, 0.0) for seat in range(self.num_players)]
