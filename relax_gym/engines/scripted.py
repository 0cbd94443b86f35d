"""A scripted engine: replies written by hand, for testing an env end to end without a trained model.

`ScriptedEngine` answers each request with the next reply of a script (a list of
assistant texts, or a function of the conversation so far), tokenized by the
model's own tokenizer and closed with its end-of-turn token. It goes through the
real rollout manager, so an episode exercises the env, the chat template, the
tool-call parser and the exact token bookkeeping exactly as a training run would;
only the sampling is replaced.

Conversations are recognised from the tokens alone, as an engine sees nothing
else: a request continues an earlier one when its `input_ids` start with that
request's `input_ids` followed by the output returned to it. The first request
of a conversation is turn 0. It keeps every conversation it served (a few
integers per token), which suits tests, not long runs.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relax_gym.engines.base import EngineError, FinishReason, GenerateOutput, GenerateRequest, RequestError

if TYPE_CHECKING:  # the engine needs no torch import of its own
    from relax_gym.models import LoadedModel

__all__ = ["ScriptError", "ScriptedEngine", "ScriptedTurn"]


class ScriptError(EngineError):
    """The script has no reply for a turn (or its function failed): the rollout manager aborts that episode."""


@dataclass(frozen=True)
class ScriptedTurn:
    """What a reply function sees: the turn and the prompt so far, as the engine received it.

    The chat messages are not here: an engine receives tokens, and `text` is them decoded
    with special tokens kept (so the last observation is its tail, in the template's markup).
    """

    #: 0 for a conversation's first request, then one more for each request that continues it
    turn: int
    text: str
    input_ids: list[int]
    request: GenerateRequest


Reply = Callable[[ScriptedTurn], str | Awaitable[str]]


class ScriptedEngine:
    """The `Engine` protocol with scripted replies instead of a model's samples.

    `replies` is a list (turn i of every conversation gets `replies[i]`) or a function of a
    `ScriptedTurn` returning the reply, sync or async. A reply is assistant text in the model
    family's format, e.g. for the tiny (Qwen/Hermes) models a tool call is
    `<tool_call>\\n{"name": "python", "arguments": {"code": "print(2 + 2)"}}\\n</tool_call>`
    (`relax_gym.tools.tool_format_for(loaded.tokenizer).write_calls([(name, args)])` writes
    one for any supported family).
    The engine tokenizes it (`add_special_tokens=False`) and, with `stop=True`, appends the
    end-of-turn token unless it already ends with one; `stop=False` leaves the turn for the
    template's glue to close, as when a stop string ends a real generation.

    The output then goes through what a real engine does to a sample: it ends at the first
    stop token id or stop string (finish_reason "stop") and is cut at `max_new_tokens`
    ("length"). Each token gets logprob `logprob` (0.0: the script is certain), and the
    output the current `weight_version`, which `update_weights` sets (the weights are
    ignored), so the engine can also stand in for one in trainer tests.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        replies: Sequence[str] | Reply,
        *,
        stop: bool = True,
        logprob: float = 0.0,
    ) -> None:
        if isinstance(replies, str) or not (callable(replies) or isinstance(replies, Sequence)):
            raise TypeError(f"replies must be a list of strings or a function, got {type(replies).__name__}")
        if not callable(replies) and not all(isinstance(r, str) for r in replies):
            raise TypeError("replies: every reply must be a string")
        self.loaded = loaded
        self.replies: tuple[str, ...] | Reply = replies if callable(replies) else tuple(replies)
        self.logprob = float(logprob)
        self.stop_token_ids = loaded.stop_token_ids()
        self.end_of_turn = self._end_of_turn() if stop else None
        self._version = 0
        self._paused = False
        self._closed = False
        self._active = 0
        self._resumed: list[asyncio.Future[None]] = []
        self._idle: list[asyncio.Future[None]] = []
        #: input_ids + output_ids of every request served -> the turn of the request continuing it
        self._next_turn: dict[tuple[int, ...], int] = {}
        #: a few tokens of each of those, so a request is compared in full only with likely prefixes
        self._fingerprints: set[tuple[int, ...]] = set()
        self._prefix_lengths: set[int] = set()

    def _end_of_turn(self) -> int:
        """The token a scripted turn ends with: the one the model's template closes turns with, if it stops on it."""
        from relax_gym.models.template_traits import turn_end_id

        return turn_end_id(self.loaded)

    # --- the Engine protocol ---------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """The script's reply for this request's turn; raises `ScriptError` when there is none."""
        self._check_open()
        if not request.input_ids:
            raise RequestError("input_ids: empty")
        if request.sampling.max_new_tokens < 0:
            raise RequestError(f"sampling.max_new_tokens: invalid value in {request.sampling}")
        while self._paused:
            waiter = asyncio.get_running_loop().create_future()
            self._resumed.append(waiter)
            await waiter
            self._check_open()
        prompt = len(request.input_ids)
        if request.sampling.max_new_tokens == 0:
            return GenerateOutput([], [], "length", self._version, prompt)
        self._active += 1
        try:
            turn = self._turn_of(request.input_ids)
            ids, reason = self._finish(self._tokenize(await self._reply(turn, request)), request)
        finally:
            self._active -= 1
            if not self._active:
                _wake(self._idle)
        key = (*request.input_ids, *ids)
        self._next_turn[key] = turn + 1
        self._fingerprints.add(_fingerprint(key, len(key)))
        self._prefix_lengths.add(len(key))
        return GenerateOutput(ids, [self.logprob] * len(ids), reason, self._version, prompt)

    async def update_weights(self, weights: Any, version: int) -> None:
        """Records `version` for the outputs that follow; the weights themselves are ignored."""
        self._check_open()
        if isinstance(version, bool) or not isinstance(version, int):
            raise RequestError(f"update_weights: version must be an int, got {version!r}")
        self._version = version

    async def pause(self) -> None:
        """Returns once no reply is being made; requests wait for `resume`."""
        self._paused = True
        while self._active:
            waiter = asyncio.get_running_loop().create_future()
            self._idle.append(waiter)
            await waiter

    async def resume(self) -> None:
        self._paused = False
        _wake(self._resumed)

    async def connect(self) -> dict[str, Any]:
        """In-process: ready once built."""
        return {"model_path": self.loaded.name, "scripted": True}

    async def health(self) -> bool:
        return not self._closed

    async def close(self) -> None:
        """Later requests raise `EngineError`, and so do requests waiting on a pause."""
        self._closed = True
        _wake(self._resumed)

    # --- the script ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"the scripted engine for {self.loaded.name!r} is closed")

    def _turn_of(self, input_ids: list[int]) -> int:
        """The turn of the conversation this request continues: the longest served prefix it starts with."""
        for length in sorted((n for n in self._prefix_lengths if n <= len(input_ids)), reverse=True):
            if _fingerprint(input_ids, length) not in self._fingerprints:
                continue
            if (turn := self._next_turn.get(tuple(input_ids[:length]))) is not None:
                return turn
        return 0

    async def _reply(self, turn: int, request: GenerateRequest) -> str:
        replies = self.replies
        if not callable(replies):
            if turn >= len(replies):
                count = f"{len(replies)} repl{'y' if len(replies) == 1 else 'ies'}"
                raise ScriptError(f"scripted engine: no reply for turn {turn}: the script has {count}")
            return replies[turn]
        text = self.loaded.decode(request.input_ids)
        try:
            reply = replies(ScriptedTurn(turn, text, list(request.input_ids), request))
            if inspect.isawaitable(reply):
                reply = await reply
        except EngineError:
            raise
        except Exception as err:  # the episode records why, as for any engine failure, and the run goes on
            raise ScriptError(f"scripted engine: the reply function raised {type(err).__name__} at turn {turn}: "
                              f"{err}") from err
        if not isinstance(reply, str):
            raise ScriptError(f"scripted engine: the reply function returned {type(reply).__name__} at turn {turn}, "
                              "not a str")
        return reply

    def _tokenize(self, text: str) -> list[int]:
        ids = list(self.loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.end_of_turn is not None and not (ids and ids[-1] in self.stop_token_ids):
            ids.append(self.end_of_turn)
        return ids

    def _finish(self, ids: list[int], request: GenerateRequest) -> tuple[list[int], FinishReason]:
        """`ids` as a real engine would return them: up to the first stop, at most `max_new_tokens`."""
        sampling = request.sampling
        stop_ids = self.stop_token_ids | set(sampling.stop_token_ids)
        decode = self.loaded.tokenizer.decode
        for i, token in enumerate(ids):
            if token in stop_ids or (sampling.stop and any(
                    s in decode(ids[: i + 1], skip_special_tokens=False) for s in sampling.stop)):
                return ids[: i + 1], "stop"
            if i + 1 >= sampling.max_new_tokens:
                return ids[: i + 1], "length"
        return ids, "stop"  # stop=False: the reply ends as if a stop string had matched


def _fingerprint(ids: Sequence[int], length: int) -> tuple[int, ...]:
    """`ids[:length]` in brief: its length and five of its tokens, cheap to take at any length."""
    return (length, ids[length - 1], ids[max(length - 2, 0)], ids[length // 2], ids[length // 3], ids[0])


def _wake(waiters: list[asyncio.Future[None]]) -> None:
    """Completes and forgets every waiter still waiting."""
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
    waiters.clear()
