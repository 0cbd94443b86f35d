"""Small OpenEnv envs served by OpenEnv's own app factory (`create_fastapi_app`) under uvicorn on loopback: the real
server code and wire protocol that `relax/OpenEnv-v0` talks to. It imports only openenv (and uvicorn), so it runs in
OpenEnv's own venv (`scripts/setup_openenv_venv.sh`), as an OpenEnv server runs in a container of its own:

    .venv-openenv/bin/python tests/support/openenv_servers.py guess 8123 [ACTION_CLASS|-] [LIMIT]
"""

from __future__ import annotations

import random
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastmcp import FastMCP
from openenv.core.env_server import Environment, MCPEnvironment, create_fastapi_app
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_ATTEMPTS = 7  # bisection finds any number in 1..100 in 7 guesses


class GuessAction(Action):
    guess: str = Field(..., description="a whole number from 1 to 100")


class NotedAction(Action):
    """Two optional string fields: which one the reply fills must be said."""

    guess: str = ""
    note: str = ""


class TwoRequiredAction(Action):
    guess: str
    note: str


class GuessObservation(Observation):
    transcript: str = Field("", description="the whole game so far: each observation repeats the history")
    attempts: int = 0


class GuessEnv(Environment):
    """Guess a number from 1 to 100 with higher/lower feedback, drawn from `reset(seed)`; 7 attempts, the number
    told when they run out."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.secret, self.attempts, self.text = 0, 0, ""

    def draw(self, seed: int | None) -> int:
        return random.Random(seed).randint(1, 100)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.secret, self.attempts = self.draw(seed), 0
        self.text = "Guess my number from 1 to 100. Reply with the number only.\n"
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(transcript=self.text)

    def judge(self, said: str) -> tuple[str, float, bool]:
        """(the line the guess adds, its reward, whether the game is over)."""
        self.attempts += 1
        number = int(said) if said.strip().isdigit() else None
        if number == self.secret:
            return f"You said {number}: correct!", 1.0, True
        over = self.attempts >= MAX_ATTEMPTS
        line = ("not a number" if number is None else
                f"You said {number}: {'higher' if self.secret > number else 'lower'}")
        return line + (f". Out of guesses: it was {self.secret}." if over else "."), 0.0, over

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        line, reward, done = self.judge(action.guess)
        self.text += line + "\n"
        self._state.step_count += 1
        return GuessObservation(transcript=self.text, attempts=self.attempts, reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state


class SeedlessGuessEnv(GuessEnv):
    """The bug of OpenEnv's TextArena server: `reset` takes a seed and ignores it, the number drawn from a fresh
    RNG; the first observation is the same either way, so only later turns show it."""

    def draw(self, seed: int | None) -> int:
        return random.SystemRandom().randint(1, 100)


class ToolGuessEnv(MCPEnvironment):
    """The same game played through MCP tools only (the Action is OpenEnv's CallToolAction): `guess(number)`."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("guess")
        self.game = GuessEnv()

        @mcp.tool
        def guess(number: int) -> str:
            """Guesses the number.

            Args:
                number: a whole number from 1 to 100, e.g. 50
            """
            line, self.reward, self.over = self.game.judge(str(number))
            return line

        super().__init__(mcp)
        self.reward, self.over = 0.0, False

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self.reward, self.over = 0.0, False
        text = self.game.reset(seed).transcript.replace("Reply with the number only.", "Call the guess tool.")
        return Observation(metadata={"prompt": text})

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(metadata={"error": f"unknown action {type(action).__name__}"})

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        observation.reward, observation.done = self.reward, self.over  # the game's verdict on the call
        return observation

    @property
    def state(self) -> State:
        return self.game.state


class HintedGuessEnv(MCPEnvironment):
    """The text game, plus an MCP tool `hint(number)` that says higher or lower without using up a guess."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("hints")
        self.game = GuessEnv()

        @mcp.tool
        def hint(number: int) -> str:
            """Says whether the number is higher or lower than `number`, without using up a guess.

            Args:
                number: a whole number from 1 to 100, e.g. 50
            """
            secret = self.game.secret
            return "that's it" if number == secret else ("higher" if secret > number else "lower")

        super().__init__(mcp)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        return self.game.reset(seed, episode_id)

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        return self.game.step(action)

    @property
    def state(self) -> State:
        return self.game.state


#: name -> (env, action, observation), for the command line
APPS: dict[str, tuple[type, type, type]] = {
    "guess": (GuessEnv, GuessAction, GuessObservation),
    "seedless": (SeedlessGuessEnv, GuessAction, GuessObservation),
    "tools": (ToolGuessEnv, CallToolAction, CallToolObservation),
    "hinted": (HintedGuessEnv, GuessAction, GuessObservation),
}


@contextmanager
def serve(env: type, action: type = GuessAction, observation: type = GuessObservation, limit: int = 16,
          port: int = 0) -> Iterator[str]:
    """The app `create_fastapi_app(env, action, observation, max_concurrent_envs=limit)` under uvicorn in a thread,
    on a socket bound before it starts; yields its URL and stops it on exit."""
    app = create_fastapi_app(env, action, observation, max_concurrent_envs=limit)
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the OpenEnv server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


if __name__ == "__main__":  # NAME PORT [ACTION_CLASS|-] [LIMIT]: serve until killed, the URL on the first line
    name, port = sys.argv[1], int(sys.argv[2])
    env, action, observation = APPS[name]
    if len(sys.argv) > 3 and sys.argv[3] != "-":
        action = globals()[sys.argv[3]]
    limit = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    with serve(env, action, observation, limit, port=port) as url:
        print(url, flush=True)
        threading.Event().wait()
