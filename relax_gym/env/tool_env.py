"""`ToolEnv`: a single-turn env whose turns may call tools.

A subclass writes the hooks of `SingleTurnEnv` (`new_task`, `prompt_messages(task)`,
`grade(task, answer)`, `task_info(task)`) plus its tools as `@tool` methods. A reply
with tool calls gets their results and another turn; the first reply without one is
graded and ends the episode. The turn loop, tool-call parsing, error observations,
turn limits and state snapshots live here once.

`tool_format` reads the model's reply: Hermes `<tool_call>` blocks by default; the
rollout manager sets the format of its model's family (`relax_gym.tools.tool_format_for`)
on an env not built with a `tool_format` of its own. `grade` gets the reply's content, without its
reasoning (a `<think>` block, harmony's analysis channel) and tool-call markup.

A task may bring tools of its own (`task_tools`: a NeMo Gym or verifiers row carries
its tool schemas), offered beside the class's for that episode only.

A turn's tool calls are bounded, since the model writes them: at most
`max_tool_calls_per_turn` run, and all of them share a `step_timeout_s` budget.
Calls to tools marked `@tool(concurrent=True)` run at the same time; the rest run
one after another in call order, as they may build on each other's effects.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from relax_gym.env.core import StepResult
from relax_gym.env.single_turn import SingleTurnEnv
from relax_gym.messages import Message, message, text
from relax_gym.tools import (
    ParsedTurn,
    SchemaTool,
    Tool,
    ToolCall,
    ToolCallFormat,
    ToolResult,
    ToolSet,
    get_tool_format,
)
from relax_gym.tools.formats import HERMES, make_call_id


class ToolEnv(SingleTurnEnv):
    """Base for tool-using envs: `self.episode` also counts turns and tool calls, so snapshots stay automatic."""

    metadata: dict[str, Any] = {**SingleTurnEnv.metadata}  # noqa: RUF012 (see Env.metadata)
    max_turns: int = 6
    #: calls past this many in one turn are not run; the model is told how many were skipped
    max_tool_calls_per_turn: int = 4
    #: seconds the tool calls of one step may take together; calls unfinished by then are reported as timed out
    step_timeout_s: float = 60.0
    #: how `step` reads tool calls, reasoning and content from the model's reply
    tool_format: ToolCallFormat = HERMES

    def __init__(
        self,
        *,
        max_turns: int | None = None,
        max_tool_calls_per_turn: int | None = None,
        step_timeout_s: float | None = None,
        tool_format: ToolCallFormat | str | None = None,
    ):
        super().__init__()
        if max_turns is not None:
            if max_turns < 1:
                raise ValueError(f"max_turns must be >= 1, got {max_turns}")
            self.max_turns = max_turns
        if max_tool_calls_per_turn is not None:
            cap = max_tool_calls_per_turn
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                raise ValueError(f"max_tool_calls_per_turn must be an int >= 1, got {cap!r}")
            self.max_tool_calls_per_turn = cap
        if step_timeout_s is not None:
            if not (isinstance(step_timeout_s, int | float) and math.isfinite(step_timeout_s) and step_timeout_s > 0):
                raise ValueError(f"step_timeout_s must be a positive number of seconds, got {step_timeout_s!r}")
            self.step_timeout_s = float(step_timeout_s)
        if tool_format is not None:
            self.tool_format = get_tool_format(tool_format) if isinstance(tool_format, str) else tool_format
        self.toolset = ToolSet(self.make_tools())
        self.metadata = {**type(self).metadata, "tools": self.toolset.names}

    def make_tools(self) -> list[Callable[..., Any]]:
        """The tools to offer: by default every method marked with `@tool` (the class's `tool_names`)."""
        return [getattr(self, n) for n in self.tool_names]

    def task_tools(self, task: Any) -> list[Tool | SchemaTool]:
        """Tools `task` brings besides the class's, for its episode only (e.g. a `SchemaTool` per schema a data
        row lists); none by default. Called at reset and again when a snapshot is restored."""
        return []

    # --- the loop -----------------------------------------------------------------
    @property
    def episode_tools(self) -> ToolSet:
        """The running episode's tools: the class's, plus its task's."""
        task = self.task
        if task is None:
            return self.toolset
        if getattr(self, "_tools_of", None) is not task:  # built once per task object, so also after `set_state`
            extra = self.task_tools(task)
            self._episode_toolset = ToolSet([*self.toolset.tools.values(), *extra]) if extra else self.toolset
            self._tools_of = task
        return self._episode_toolset

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.episode_tools.schemas

    def parse_reply(self, action: str) -> ParsedTurn:
        """The reply's content, reasoning and calls: `tool_format`'s reading, which an env may widen."""
        return self.tool_format.parse(action)

    def _start_episode(self, task: Any) -> dict[str, Any]:
        return {**super()._start_episode(task), "turn": 0, "tool_calls": 0, "tool_successes": 0, "tool_errors": 0}

    def step(self, action: str) -> StepResult:
        ep = self.running_episode()
        ep["turn"] += 1
        parsed = self.parse_reply(action)
        if not parsed.has_tool_calls:
            return self._finish(parsed.content)
        observation: list[Message] = []
        # a format whose templates want an id on every tool result (Mistral v3) gets one on each, made up
        # for parser errors and notes, which answer no call; otherwise only a call that carries one passes it on
        needs_ids = bool(getattr(self.tool_format, "call_ids", False))

        def ids(call_id: str | None, *seed: Any) -> dict[str, str]:
            if call_id is None and needs_ids:
                call_id = make_call_id(ep["turn"], *seed)
            return {} if call_id is None else {"tool_call_id": call_id}

        for i, err in enumerate(parsed.errors):
            ep["tool_errors"] += 1
            note = text(f"Error: {err.message}")
            observation.append(message("tool", note, name="tool_call_parser", **ids(None, "error", i)))
        cap = self.max_tool_calls_per_turn
        calls, skipped = parsed.calls[:cap], len(parsed.calls) - cap
        for j, (call, outcome) in enumerate(zip(calls, self._run_calls(calls), strict=True)):
            ep["tool_calls"] += 1
            if outcome is None:
                late = f"Error: {call.name}: tool call timed out after the step budget of {self.step_timeout_s:g} s"
                outcome = ToolResult([text(late)], is_error=True)
            ep["tool_errors"] += outcome.is_error
            ep["tool_successes"] += not outcome.is_error
            observation.append(message("tool", *outcome.content, name=call.name, **ids(call.id, "call", j)))
        if skipped > 0:
            ep["tool_errors"] += skipped
            limit = f"Error: {skipped} more tool call(s) were not run: at most {cap} tool calls are run per turn."
            observation.append(message("tool", text(limit), name="tool_call_limit", **ids(None, "limit")))
        if ep["turn"] >= self.max_turns:
            ep["done"] = True
            return observation, 0.0, False, True, self._info(truncated_by="max_turns")
        return observation, 0.0, False, False, self._info()

    def _run_calls(self, calls: Sequence[ToolCall]) -> list[ToolResult | None]:
        """Each call's result in call order; None for a call unfinished when the step's budget ran out.

        Concurrent-safe calls get a thread each, the others share one thread that runs
        them in order and starts none once the budget is spent. Threads are daemons, as
        Python cannot stop a thread: a call past the deadline is abandoned, never awaited,
        and its late result is dropped (an order-dependent tool's late effect may still land).
        """
        results: list[ToolResult | None] = [None] * len(calls)
        expired = threading.Event()
        tools = self.episode_tools

        def run(indices: list[int]) -> None:
            for i in indices:
                if expired.is_set():
                    return
                try:
                    results[i] = tools.execute(calls[i])
                except BaseException as err:  # Tool catches Exception; SystemExit and the like end up here
                    failed = f"Error: {calls[i].name} failed: {type(err).__name__}"
                    results[i] = ToolResult([text(failed)], is_error=True)

        ordered = [i for i, call in enumerate(calls) if not tools.concurrent(call)]
        groups = [[i] for i, call in enumerate(calls) if tools.concurrent(call)] + ([ordered] if ordered else [])
        threads = [threading.Thread(target=run, args=(g,), name="relax_gym-tool", daemon=True) for g in groups]
        deadline = time.monotonic() + self.step_timeout_s
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        expired.set()
        return list(results)

    def _info(self, **extra: Any) -> dict[str, Any]:
        ep = self.episode
        counts = {k: ep[k] for k in ("turn", "tool_calls", "tool_successes", "tool_errors")}
        return {**counts, **super()._info(**extra)}
