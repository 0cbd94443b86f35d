"""Games the policy plays in several seats at once (self-play): one game, one episode per seat.

A zero-sum game gives its seats +1 and -1, so neither an `Env` (one policy seat) nor an `AgentEnv` (one reward
per episode) can train both sides of one game. A `SeatedGame` is an `Env` whose `policy_seats` is above 1; the
rollout manager then plays each game as `policy_seats` ordinary episodes that share it through a `GameTable`,
each seat seen through a `SeatView` (an `Env` over that seat), so tokens, loss masks, limits and failures are
those of any episode.

The contract (docs/envs.md, "Self-play"):
- A group of `group_size` games starts from one seed; each game gives one trajectory per seat.
- A seat's group id is the group's with `@seat{N}`: its advantage baseline is the mean reward of the same seat
  over the group's games, so a first mover's edge is not credited to its moves. (With one game a group a seat's
  baseline is its own reward: self-play needs `group_size` of 2 or more, as GRPO does.)
- A seat waits for its turn inside `reset` and `step`; the other seats' moves reach it through `observe`.
- A seat whose episode ends before the game does (its reply ran out of tokens, the engine failed) ends the game
  for all: the others end `truncated` ("seat N left"), with reward 0.
- A game that ends before a seat's first turn (by its rules, or because another seat left) gives that seat a
  `truncated` episode without a reply, saying so: nothing broke, and there is nothing of it to train.

The names follow PettingZoo's AEC games: `seat_to_move` is its `agent_selection`, `observe(seat)` its
`observe(agent)`, `seat_rewards` its `rewards` at the end.
"""

from __future__ import annotations

import asyncio
from typing import Any

from relax_gym.env.core import Env, StepResult


class SeatedGame(Env):
    """A turn-based game for several policy seats; an ordinary `Env` while `policy_seats` is 1.

    Subclasses implement the four seat methods below. They run on the event loop one at a time (the table holds
    a lock), in a worker thread when the class is `blocking`."""

    #: how many seats the policy plays, each its own episode; 1: the env plays as an ordinary `Env`
    policy_seats: int = 1

    def reset_game(self, seed: int | None, options: dict[str, Any] | None) -> None:
        """Starts a new game; `seed` names it (the same seed, the same game)."""
        raise NotImplementedError

    def seat_to_move(self) -> int | None:
        """The seat whose move the game waits for; None once the game is over."""
        raise NotImplementedError

    def observe(self, seat: int) -> Any:
        """What `seat` has not seen yet (the observation `format_observation` renders), marking it seen."""
        raise NotImplementedError

    def act(self, action: str) -> None:
        """The seat to move plays `action` (the policy's reply text)."""
        raise NotImplementedError

    def seat_rewards(self) -> list[float]:
        """Each seat's reward once the game is over (e.g. +1 and -1 for a win)."""
        raise NotImplementedError


class GameEndedError(RuntimeError):
    """The game ended before this seat's first move: its episode ends `truncated`, with no reply."""


class GameTable:
    """One game shared by its seats' episodes: resets it once, runs moves one at a time, wakes the seat to move."""

    def __init__(self, game: SeatedGame):
        self.game = game
        self._turns = asyncio.Condition()
        self._started: asyncio.Task[None] | None = None
        self.to_move: int | None = None
        #: why the game ended early (a seat left); "" while it runs or when it ended by its rules
        self.left = ""

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args) if self.game.blocking else fn(*args)

    async def start(self, seed: int | None, options: dict[str, Any] | None) -> None:
        """Resets the game once, whichever seat comes first; every seat sees the same error if it failed."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._reset(seed, options))
        await asyncio.shield(self._started)

    async def _reset(self, seed: int | None, options: dict[str, Any] | None) -> None:
        async with self._turns:
            await self._call(self.game.reset_game, seed, options)
            self.to_move = self.game.seat_to_move()
            self._turns.notify_all()

    @property
    def over(self) -> bool:
        return bool(self.left) or self.to_move is None

    async def wait_turn(self, seat: int) -> None:
        async with self._turns:
            await self._turns.wait_for(lambda: self.over or self.to_move == seat)

    async def act(self, seat: int, action: str) -> None:
        async with self._turns:
            if self.over or self.to_move != seat:
                raise RuntimeError(f"seat {seat} moved out of turn (the game waits for {self.to_move})")
            try:
                await self._call(self.game.act, action)
            finally:  # a move that raised ends the game for everyone (`leave` follows from the episode)
                self.to_move = self.game.seat_to_move()
                self._turns.notify_all()

    async def leave(self, seat: int, why: str) -> None:
        """`seat`'s episode is over; a game still running ends for the other seats."""
        async with self._turns:
            if not self.over:
                self.left = f"seat {seat} left: {why}"
                self._turns.notify_all()


class SeatView(Env):
    """One seat of a shared game as an `Env`: `reset` and `step` return when it is this seat's turn again."""

    blocking = False  # its async methods wait on the table; the game's own calls go to threads there

    def __init__(self, table: GameTable, seat: int):
        self.table, self.seat = table, seat
        self.metadata = table.game.metadata

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.table.game.tool_schemas

    def format_observation(self, observation: Any) -> Any:
        return self.table.game.format_observation(observation)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        raise TypeError("a SeatView is played through areset/astep (its turn comes when the other seats have moved)")

    def step(self, action: str) -> StepResult:
        raise TypeError("a SeatView is played through areset/astep (its turn comes when the other seats have moved)")

    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        await self.table.start(seed, options)
        await self.table.wait_turn(self.seat)
        if self.table.over:
            why = self.table.left or "by its rules"
            raise GameEndedError(f"the game ended before seat {self.seat} moved ({why})")
        return self.table.game.observe(self.seat), {"seat": self.seat}

    async def astep(self, action: str) -> StepResult:
        table = self.table
        await table.act(self.seat, action)
        await table.wait_turn(self.seat)
        info: dict[str, Any] = {"seat": self.seat}
        if not table.over:
            return table.game.observe(self.seat), 0.0, False, False, info
        if table.left:
            return [], 0.0, False, True, {**info, "truncated_by": table.left}
        rewards = [float(r) for r in table.game.seat_rewards()]
        return [], rewards[self.seat], True, False, {**info, "seat_rewards": rewards}
