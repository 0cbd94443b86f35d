"""Conformance checks for environments: gymnasium's `check_env` plus what relax_gym relies on.

The rollout manager assumes more than gymnasium checks: observations render to
valid chat messages, the same seed gives the same prompt (and the same whole
episode, for the same actions, in two fresh envs), any text the model
writes is survivable, `info` can be written to JSONL, snapshots resume exactly,
and the modalities an env declares are the ones it emits. Each check runs on
its own so one failure does not hide the others.

A check passes, fails, or was *not exercised*: random text never calls a tool,
so a snapshot taken after it cannot show state the tools keep. The state check
therefore plays actions that reach the tools: the env's `scripted_actions()`
hook (see `ScriptedEnv`; every bundled env has one), or calls synthesised from
the tool schemas; when none holds state to restore it says so instead of passing.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import math
import re
import traceback
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
from gymnasium.utils.env_checker import check_env, data_equivalence

from relax_gym.env.core import Env
from relax_gym.env.registration import (
    check_kwargs,
    env_class,
    import_env_source,
    list_envs,
    make,
    resolve_env_id,
    spec,
    split_env_target,
)
from relax_gym.env.seats import SeatedGame
from relax_gym.messages import MessageError, modalities, text_content, validate_messages
from relax_gym.tools.formats import HERMES, ToolCallFormat

N_SEEDS = 3
RANDOM_EPISODES = 4
MAX_STEPS = 8
#: answers drawn from an observation that a seeded replay plays before random text (`observed_answers`)
MAX_DRAWN = 12
STATE_SEED = 7
TOOL_ATTEMPTS = 4  # argument guesses per tool

PASSED, FAILED, NOT_EXERCISED = "passed", "failed", "not exercised"


@runtime_checkable
class ScriptedEnv(Protocol):
    """The optional hook an env offers so checks and benchmarks can play it through its tools.

    `scripted_actions()` is called right after `reset` and returns the
    assistant turns of one plausible episode: tool calls that succeed (so
    the state the tools keep gets built), then an answer. They need not win.
    """

    def scripted_actions(self) -> list[str]: ...


@dataclass
class CheckResult:
    name: str
    status: str  # PASSED, FAILED or NOT_EXERCISED
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "passed": self.passed, "detail": self.detail}


@dataclass
class CheckReport:
    target: str
    results: list[CheckResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """No check failed; one that was not exercised does not fail the run, but `not_exercised` names it."""
        return all(r.status != FAILED for r in self.results)

    @property
    def not_exercised(self) -> list[str]:
        return [r.name for r in self.results if r.status == NOT_EXERCISED]

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "passed": self.passed, "not_exercised": self.not_exercised,
                "results": [r.to_dict() for r in self.results], "warnings": list(self.warnings)}


class CheckFailure(AssertionError):
    pass


class NotExercised(Exception):
    """The check ran but nothing it did could have shown a failure."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailure(message)


def _rendered(env: Env, obs: Any, where: str) -> list:
    try:
        msgs = env.format_observation(obs)
        validate_messages(msgs)
    except MessageError as err:
        raise CheckFailure(f"{where}: format_observation returned invalid messages: {err}") from err
    return msgs


def _json_info(info: Any, where: str) -> None:
    _require(isinstance(info, dict), f"{where}: info must be a dict, got {type(info).__name__}")
    try:
        json.dumps(info)
    except (TypeError, ValueError) as err:
        raise CheckFailure(f"{where}: info is not JSON-serialisable: {err}") from err


def check_gymnasium(make_env: Callable[[], Env]) -> str:
    env = make_env()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env, skip_render_check=True)
    env.close()
    return "; ".join(sorted({str(w.message) for w in caught}))


def check_reset(make_env: Callable[[], Env]) -> str:
    env = make_env()
    for seed in range(N_SEEDS):
        obs_a, info_a = env.reset(seed=seed)
        msgs_a = copy.deepcopy(_rendered(env, obs_a, f"reset(seed={seed})"))
        _require(len(msgs_a) > 0, f"reset(seed={seed}) rendered no messages: the model would get an empty prompt")
        _json_info(info_a, f"reset(seed={seed})")
        obs_b, _ = env.reset(seed=seed)
        msgs_b = _rendered(env, obs_b, f"reset(seed={seed}) again")
        _require(data_equivalence(msgs_a, msgs_b), f"reset(seed={seed}) twice gave different observations")
        _require(
            data_equivalence(msgs_b, _rendered(env, obs_b, "format_observation again")),
            "format_observation gave different messages for the same observation",
        )
    env.close()
    return f"{N_SEEDS} seeds"


def check_random_actions(make_env: Callable[[], Env]) -> str:
    env = make_env()
    steps = 0
    probes = ["", "<tool_call>", "<tool_call>{not json</tool_call>", '<tool_call>{"name": 1}</tool_call>', "\x00" * 5]
    for episode in range(RANDOM_EPISODES + len(probes)):
        env.reset(seed=100 + episode)
        env.action_space.seed(episode)
        for t in range(MAX_STEPS):
            action = probes[episode - RANDOM_EPISODES] if episode >= RANDOM_EPISODES and t == 0 else None
            action = env.action_space.sample() if action is None else action
            where = f"episode {episode} step {t}"
            try:
                obs, reward, terminated, truncated, info = env.step(action)
            except Exception as err:
                raise CheckFailure(f"{where}: step({action[:60]!r}) raised {type(err).__name__}: {err}") from err
            steps += 1
            _rendered(env, obs, where)
            _json_info(info, where)
            _require(isinstance(reward, int | float | np.number) and math.isfinite(float(reward)),
                     f"{where}: reward {reward!r} is not a finite number")
            _require(isinstance(terminated, bool | np.bool_) and isinstance(truncated, bool | np.bool_),
                     f"{where}: terminated/truncated must be bools")
            if terminated or truncated:
                break
    env.close()
    return f"{steps} steps over {RANDOM_EPISODES + len(probes)} episodes"


def check_modalities(make_env: Callable[[], Env]) -> str:
    env = make_env()
    declared = set(env.metadata.get("modalities", ("text",)))
    seen: set[str] = set()
    for seed in range(N_SEEDS):
        obs, _ = env.reset(seed=seed)
        seen |= modalities(_rendered(env, obs, f"reset(seed={seed})"))
        env.action_space.seed(seed)
        obs, *_ = env.step(env.action_space.sample())
        seen |= modalities(_rendered(env, obs, f"step after reset(seed={seed})"))
    env.close()
    extra = seen - declared
    _require(not extra, f"returned {sorted(extra)} content but metadata['modalities'] declares {sorted(declared)}")
    missing = declared - seen - {"text"}
    _require(not missing, f"declares {sorted(missing)} but returned none in {N_SEEDS} episodes")
    return f"declared {sorted(declared)}"


def check_tools(make_env: Callable[[], Env]) -> str:
    env = make_env()
    schemas = list(getattr(env, "tool_schemas", []) or [])
    names = []
    for s in schemas:
        fn = s.get("function", {}) if isinstance(s, dict) else {}
        _require(s.get("type") == "function" and isinstance(fn.get("name"), str), f"malformed tool schema {s!r}")
        _require(fn.get("parameters", {}).get("type") == "object", f"tool {fn['name']}: parameters must be an object")
        json.dumps(s)
        names.append(fn["name"])
    declared = list(env.metadata.get("tools", ()))
    _require(sorted(declared) == sorted(names), f"metadata['tools'] {declared} != offered tool schemas {names}")
    env.close()
    return f"{len(names)} tools"


def tool_call(name: str, arguments: dict[str, Any], tool_format: ToolCallFormat = HERMES) -> str:
    """An action calling one tool, in `tool_format` (an env's `tool_format`; Hermes `<tool_call>` by default)."""
    return tool_format.write_calls([(name, arguments)])


def scripted_actions(env: Env) -> list[str]:
    """Actions that play `env`'s current episode and reach its tools: its `scripted_actions()` hook (see
    `ScriptedEnv`), or [] when it has none. The conformance checker and `benchmarks/env_step.py` both play these,
    so they cannot drift."""
    hook = getattr(env, "scripted_actions", None)
    return [a for a in hook() if isinstance(a, str)] if callable(hook) else []


_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")
_QUOTED = re.compile(r""""([^"]{1,40})"|`([^`]{1,40})`|(?<!\w)'([^']{1,40})'""")


def _plausible_values(schema: dict[str, Any]) -> list[Any]:
    """Values for one JSON-schema parameter, likeliest first: its enum, examples its description gives, stock ones."""
    if schema.get("enum"):
        return list(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None and isinstance(schema.get("anyOf"), list):
        kind = next((s.get("type") for s in schema["anyOf"] if isinstance(s, dict) and s.get("type") != "null"), None)
    described = str(schema.get("description", ""))
    numbers = [float(n) for n in _NUMBER.findall(described)]
    if kind == "integer":
        return [*dict.fromkeys([int(n) for n in numbers if n.is_integer()] + [1, 2, 0, 10])]
    if kind == "number":
        return [*dict.fromkeys([*numbers, 1.0, 0.5, 10.0])]
    if kind == "boolean":
        return [True, False]
    if kind == "string":
        quoted = ["".join(groups) for groups in _QUOTED.findall(described)]
        return [*dict.fromkeys([*quoted, "1", "test", "a"])]
    if kind == "array":
        items = schema.get("items")
        if not isinstance(items, dict):
            items = {}
        if items.get("type") in ("integer", "number"):
            return [[10, 10, 100, 100], [1, 2], []]
        return [[v] for v in _plausible_values(items)[:2]] + [[]] if items else [[]]
    if kind == "object":
        return [_arguments(schema, 0)]
    return [None]


def _arguments(parameters: dict[str, Any], attempt: int) -> dict[str, Any]:
    """The `attempt`-th guess at arguments: required ones only, each cycling through its plausible values."""
    props = parameters.get("properties") or {}
    required = [n for n in parameters.get("required", list(props)) if n in props]
    out = {}
    for name in required:
        values = _plausible_values(props[name] if isinstance(props[name], dict) else {})
        out[name] = values[attempt % len(values)]
    return out


def _tool_names(env: Env) -> list[str]:
    return [s["function"]["name"] for s in getattr(env, "tool_schemas", None) or []
            if isinstance(s, dict) and isinstance(s.get("function", {}).get("name"), str)]


def _reached_tool(before: dict[str, Any], info: dict[str, Any], msgs: list, names: list[str]) -> bool:
    """Whether a step ran a tool without error: ToolEnv counts successes in `info`, other envs show tool messages."""
    if isinstance(info.get("tool_successes"), int):
        return info["tool_successes"] > int(before.get("tool_successes", 0) or 0)
    for m in msgs:
        first = next((p.get("text", "") for p in m.get("content", []) if p.get("type") == "text"), "")
        if m.get("role") == "tool" and m.get("name") in names and not first.startswith("Error"):
            return True
    return False


def synthesised_tool_calls(make_env: Callable[[], Env]) -> list[str]:
    """One working call per tool, its arguments guessed from the schema: each guess is tried on a fresh episode."""
    env = make_env()
    calls = []
    try:
        for schema in getattr(env, "tool_schemas", None) or []:
            fn = schema.get("function", {}) if isinstance(schema, dict) else {}
            if not isinstance(fn.get("name"), str):
                continue
            for attempt in range(TOOL_ATTEMPTS):
                action = tool_call(fn["name"], _arguments(fn.get("parameters") or {}, attempt),
                                   getattr(env, "tool_format", HERMES))
                _, info = env.reset(seed=STATE_SEED)
                obs, *_, step_info = env.step(action)
                if _reached_tool(info, step_info, env.format_observation(obs), [fn["name"]]):
                    calls.append(action)
                    break
    finally:
        env.close()
    return calls


def _differs(a: Any, b: Any) -> bool:
    try:
        return not data_equivalence(a, b)
    except Exception:  # a snapshot gymnasium cannot compare: assume it differs rather than call the check idle
        return True


def _outcome(env: Env, result: tuple) -> tuple:
    obs, reward, terminated, truncated, _ = result
    return copy.deepcopy(env.format_observation(obs)), float(reward), bool(terminated), bool(truncated)


def _difference(want: tuple, got: tuple) -> str:
    """What differs between two `_outcome`s: "" when nothing, else "observation" or "reward/terminated/truncated"."""
    if not data_equivalence(want[0], got[0]):
        return "observation"
    return "" if want[1:] == got[1:] else "reward/terminated/truncated"


def _replay(env: Env, actions: list[str], expected: list[tuple], where: str, first: int) -> None:
    for offset, (action, want) in enumerate(zip(actions, expected, strict=True)):
        what = _difference(want, _outcome(env, env.step(action)))
        if what:
            raise CheckFailure(f"{where}, step {first + offset + 1} ({action[:60]!r}) differs from the original "
                               f"episode in its {what}: get_state/set_state misses part of the state")


def _playable_actions(env: Env, make_env: Callable[[], Env], seed: int, obs: Any = None) -> tuple[list[str], str]:
    """What a check plays after `env.reset(seed=seed)` (which gave `obs`), and what they are: the env's scripted
    actions, else calls synthesised from its tool schemas, else answers drawn from `obs`, then its action space's
    samples under `seed`."""
    actions = scripted_actions(env)
    if actions:
        return actions, "scripted actions"
    if _tool_names(env):
        return synthesised_tool_calls(make_env) * 2, "synthesised tool calls"
    env.action_space.seed(seed)
    drawn = observed_answers(env, obs) if obs is not None else []
    sampled = [env.action_space.sample() for _ in range(MAX_STEPS if not drawn else 2)]
    return [*drawn, *sampled], ("answers drawn from the observation and " if drawn else "") + "random actions"


def observed_answers(env: Env, obs: Any) -> list[str]:
    """Answers an env's logic is likely to read, drawn from its first observation: the numbers it shows, then the
    integers that halve the span between the least and the greatest (a range to guess in) breadth first, then
    what it quotes (the options it offers); at most MAX_DRAWN. Random text is often answered only "reply with
    one integer", in every episode alike, so a seed that picks nothing but hidden state (the number to guess)
    would never show; a guess it can read is answered in a way that does."""
    try:
        shown = "\n".join(text_content(m) for m in env.format_observation(obs))
    except Exception:  # format_observation has a check of its own; here it only offers answers
        return []
    numbers = [float(n) for n in _NUMBER.findall(shown)][:4]
    answers = [f"{n:g}" for n in numbers]
    if len(numbers) > 1:
        spans = deque([(min(numbers), max(numbers))])
        while spans and len(answers) < MAX_DRAWN:
            low, high = spans.popleft()
            if high - low > 1:
                middle = round((low + high) / 2)
                answers.append(str(middle))
                spans.extend([(low, middle), (middle, high)])
    answers += ["".join(groups) for groups in _QUOTED.findall(shown)][:4]
    return [*dict.fromkeys(answers)][:MAX_DRAWN]


def check_state(make_env: Callable[[], Env]) -> str:
    """Plays actions that reach the env's tools, snapshotting before each; every snapshot must replay identically.

    A snapshot is restored into another env (after its own reset) and into
    the same env after it moved on. When no snapshot held state that tools
    built (or, without tools, anything a reset env lacks), the round trip
    proved nothing, and the check says it was not exercised.
    """
    env = make_env()
    if not env.supports_state:
        env.close()
        return "not offered"
    names = _tool_names(env)
    _, info = env.reset(seed=STATE_SEED)
    actions, source = _playable_actions(env, make_env, STATE_SEED)
    snapshots, expected, tools_before = [], [], []
    reached = False
    for action in actions[:MAX_STEPS]:
        snapshots.append(copy.deepcopy(env.get_state()))
        tools_before.append(reached)
        result = env.step(action)
        expected.append(_outcome(env, result))
        reached |= _reached_tool(info, result[4], expected[-1][0], names)
        info = result[4]
        if result[2] or result[3]:
            break
    played = actions[: len(expected)]
    other = make_env()
    exercised = 0
    try:
        for k, snapshot in enumerate(snapshots):
            other.reset(seed=0)
            if _differs(snapshot, other.get_state()) and (tools_before[k] or not names):
                exercised += 1
            other.set_state(copy.deepcopy(snapshot))
            _replay(other, played[k:], expected[k:], f"after set_state(snapshot before step {k + 1}) in another env", k)
        for k in reversed(range(len(snapshots))):
            env.set_state(copy.deepcopy(snapshots[k]))
            _replay(env, played[k:], expected[k:], f"after rewinding the same env to before step {k + 1}", k)
    finally:
        env.close()
        other.close()
    if not exercised:
        if names:
            scripted = source == "scripted actions"
            tried = f"in {len(played)} {source}" if scripted else (
                f"with {TOOL_ATTEMPTS} argument guesses per tool, nor in {len(played)} {source}")
            fix = "make its scripted_actions() call them" if scripted else "give the env a scripted_actions() hook"
            raise NotExercised(f"no call to {', '.join(names)} succeeded {tried}, so no snapshot held state the "
                               f"tools keep; {fix}")
        raise NotExercised(f"no snapshot over {len(played)} {source} held anything a freshly reset env lacks, "
                           "so set_state had nothing to restore")
    return f"{exercised} of {len(snapshots)} snapshots over {len(played)} {source} resume identically"


def check_seeded_replay(make_env: Callable[[], Env]) -> str:
    """Two fresh envs reset with one seed and played the same actions, step by step in turn, must give the same
    observations, rewards and ends: the seed names the whole task, as a GRPO group (one seed, several samples)
    and an exact resume assume.

    `check_reset` cannot see a seed that picks nothing but hidden state (a secret number, a deck, a server that
    ignores `reset(seed)`): the first observation does not show it, the later turns and the reward do. Playing
    the two envs in turn also catches an episode drawn lazily from a process-wide RNG, which another episode
    in the same process moves.
    """
    steps, sources = 0, set()
    for seed in range(N_SEEDS):
        first, second = make_env(), make_env()
        try:
            obs_a, _ = first.reset(seed=seed)
            obs_b, _ = second.reset(seed=seed)
            _require(data_equivalence(_rendered(first, obs_a, f"reset(seed={seed})"),
                                      _rendered(second, obs_b, f"reset(seed={seed}) in another env")),
                     f"reset(seed={seed}) in two fresh envs gave different observations")
            actions, source = _playable_actions(first, make_env, seed, obs_a)
            sources.add(source)
            for t, action in enumerate(actions[:MAX_STEPS + MAX_DRAWN]):
                want, got = _outcome(first, first.step(action)), _outcome(second, second.step(action))
                steps += 1
                what = _difference(want, got)
                if what:
                    shown = "observations" if what == "observation" else f"{what} ({want[1:]} against {got[1:]})"
                    raise CheckFailure(
                        f"seed {seed}, step {t + 1} ({action[:60]!r}): two fresh envs reset with the same seed and "
                        f"given the same actions gave different {shown}: the seed does not name the whole task "
                        "(is reset(seed) passed on to what draws it?), so one GRPO group would compare different "
                        "tasks")
                if want[2] or want[3]:
                    break
        finally:
            first.close()
            second.close()
    return f"{N_SEEDS} seeds, {steps} steps of {' and '.join(sorted(sources))}"


def check_async(make_env: Callable[[], Env]) -> str:
    env = make_env()

    async def run() -> None:
        obs, _ = await env.areset(seed=0)
        sync_obs, _ = make_env().reset(seed=0)
        _require(data_equivalence(env.format_observation(obs), env.format_observation(sync_obs)),
                 "areset(seed=0) differs from reset(seed=0)")
        await env.astep("")

    asyncio.run(run())
    env.close()
    return "areset/astep"


CHECKS: list[tuple[str, Callable[[Callable[[], Env]], str]]] = [
    ("gymnasium.check_env", check_gymnasium),
    ("reset is deterministic per seed", check_reset),
    ("seeded replay in fresh envs", check_seeded_replay),
    ("random actions never crash", check_random_actions),
    ("declared modalities match", check_modalities),
    ("tool schemas", check_tools),
    ("state round trip", check_state),
    ("async api", check_async),
]


def _play_seats(game: SeatedGame, seed: int, moves: list[str] | None = None) -> tuple[list[str], list[Any]]:
    """Plays a self-play game from `seed` through its seats, on `moves` or else the game's scripted actions (the
    first each time), up to MAX_STEPS * seats moves: (the moves, what each seat saw before each and the end)."""
    game.reset_game(seed, None)
    played: list[str] = []
    seen: list[Any] = []
    while (seat := game.seat_to_move()) is not None and len(played) < MAX_STEPS * game.policy_seats:
        seen.append((seat, _rendered(game, game.observe(seat), f"observe({seat}) after {len(played)} moves")))
        if moves is not None and len(played) >= len(moves):
            break
        move = moves[len(played)] if moves is not None else (scripted_actions(game) or [""])[0]
        game.act(move)
        played.append(move)
    if game.seat_to_move() is None:
        rewards = [float(r) for r in game.seat_rewards()]
        _require(len(rewards) == game.policy_seats and all(math.isfinite(r) for r in rewards),
                 f"seat_rewards() gave {rewards}, not a finite reward for each of {game.policy_seats} seats")
        seen.append(("end", rewards))
    return played, seen


def check_seats(make_env: Callable[[], Env]) -> str:
    """A self-play game plays through its seats, its observations render, and it ends with a reward a seat."""
    game = make_env()
    assert isinstance(game, SeatedGame)
    played, seen = _play_seats(game, 0)
    game.close()
    if seen[-1][0] != "end":
        raise NotExercised(f"the scripted moves did not end the game in {len(played)} moves")
    return f"{len(played)} moves, seat rewards {seen[-1][1]}"


def check_seated_replay(make_env: Callable[[], Env]) -> str:
    """Two fresh games from one seed, the same moves: the same observations for every seat and the same rewards
    (a group's games must start alike, or its seats' baselines compare different games)."""
    first, second = make_env(), make_env()
    assert isinstance(first, SeatedGame) and isinstance(second, SeatedGame)
    played, seen = _play_seats(first, 1)
    _, again = _play_seats(second, 1, played)
    for index, (want, got) in enumerate(zip(seen, again, strict=False)):
        if not data_equivalence(want, got):
            raise CheckFailure(f"a fresh game from seed 1 replaying the same moves differs at observation {index} "
                               f"({want[0]}): the seed does not name the game")
    _require(len(seen) == len(again), f"replaying {len(played)} moves gave {len(again)} observations, not "
             f"{len(seen)}")
    return f"{len(played)} moves replayed"


SEATED_CHECKS: list[tuple[str, Callable[[Callable[[], Env]], str]]] = [
    ("self-play game plays through its seats", check_seats),
    ("seeded replay in fresh games", check_seated_replay),
]


def _construct_failure(err: Exception) -> str:
    """One line: for an env made without a required argument, which ones to pass (Python's own TypeError names
    them: "missing 1 required positional argument: 'url'")."""
    missing = re.search(r"missing \d+ required (?:positional |keyword-only )?arguments?: (.+)$", str(err))
    if isinstance(err, TypeError) and missing:
        names = re.findall(r"'(\w+)'", missing.group(1))
        flags = " ".join(f"--env-arg {name}=VALUE" for name in names)
        return f"the env needs {', '.join(names)}: pass {flags} (Python: {err})"
    return f"{type(err).__name__}: {err}"


def run_checks(target: str, make_env: Callable[[], Env]) -> CheckReport:
    report = CheckReport(target)
    try:
        probe = make_env()
    except Exception as err:
        report.results.append(CheckResult("construct", FAILED, _construct_failure(err)))
        return report
    if not isinstance(probe, Env):
        report.results.append(CheckResult("is a relax_gym.Env", FAILED, f"got {type(probe).__name__}"))
        return report
    seated = isinstance(probe, SeatedGame) and probe.policy_seats > 1  # played through seats, not reset/step
    probe.close()
    for name, check in SEATED_CHECKS if seated else CHECKS:
        try:
            detail = check(make_env)
            if name == "gymnasium.check_env" and detail:
                report.warnings.append(detail)
                detail = "passed with warnings"
            report.results.append(CheckResult(name, PASSED, detail))
        except NotExercised as err:
            report.results.append(CheckResult(name, NOT_EXERCISED, str(err)))
        except CheckFailure as err:
            report.results.append(CheckResult(name, FAILED, str(err)))
        except Exception as err:
            where = traceback.extract_tb(err.__traceback__)[-1]
            report.results.append(CheckResult(
                name, FAILED, f"{type(err).__name__}: {err} (at {Path(where.filename).name}:{where.lineno})"))
    return report


def resolve(target: str, env_kwargs: dict[str, Any] | None = None) -> list[tuple[str, Callable[[], Env]]]:
    """(name, factory) pairs for what `relax-gym check` takes: any env target `registration.resolve_env_id`
    names, and two more only a check makes sense of: a file or module that registers several ids (each is
    checked), and `source:Class` for a class `source` defines, registered or not (made directly, under the
    target's name).

    `env_kwargs` go to each factory and are checked here, so a misspelt one is a single error line, not a
    failed check.
    """
    kwargs = dict(env_kwargs or {})
    source, name = (None, "") if target in list_envs() else split_env_target(target)
    if source is not None:
        module, ids = import_env_source(source)
        if not name and len(ids) > 1:
            return [_made(env_id, kwargs) for env_id in ids]
        cls = getattr(module, name, None) if name and name not in list_envs() else None
        if cls is not None:
            check_kwargs(target, cls, kwargs)
            return [(target, lambda: cls(**kwargs))]
    return [_made(resolve_env_id(target), kwargs)]


def _made(env_id: str, kwargs: dict[str, Any]) -> tuple[str, Callable[[], Env]]:
    check_kwargs(env_id, env_class(env_id), {**spec(env_id).kwargs, **kwargs})
    return env_id, functools.partial(make, env_id, **kwargs)
