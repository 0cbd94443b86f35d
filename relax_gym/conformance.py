"""Conformance checks for environments: gymnasium's `check_env` plus what relax_gym relies on.

The rollout manager assumes more than gymnasium checks: observations render to
valid chat messages, the same seed gives the same prompt, any text the model
writes is survivable, `info` can be written to JSONL, snapshots resume exactly,
and the modalities an env declares are the ones it emits. Each check runs on
its own so one failure does not hide the others.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import importlib.util
import json
import math
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium.utils.env_checker import check_env, data_equivalence

from relax_gym.core import Env
from relax_gym.messages import MessageError, modalities, validate_messages
from relax_gym.registration import list_envs, make

N_SEEDS = 3
RANDOM_EPISODES = 4
MAX_STEPS = 8


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str = ""


@dataclass
class CheckReport:
    target: str
    results: list[CheckResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "passed": self.passed, **asdict(self)}


class CheckFailure(AssertionError):
    pass


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


def check_state(make_env: Callable[[], Env]) -> str:
    env = make_env()
    if not env.supports_state:
        return "not offered"
    env.reset(seed=7)
    env.action_space.seed(7)
    first = env.action_space.sample()
    _, _, terminated, truncated, _ = env.step(first)
    if terminated or truncated:
        env.reset(seed=7)
    snapshot = copy.deepcopy(env.get_state())
    action = env.action_space.sample()
    expected = copy.deepcopy(env.step(action))
    fresh = make_env()
    fresh.reset(seed=0)
    fresh.set_state(snapshot)
    got = fresh.step(action)
    _require(data_equivalence(expected[:2], got[:2]) and expected[2:4] == got[2:4],
             "a step after set_state(get_state()) differs from the original step")
    env.close()
    fresh.close()
    return "round trip resumes identically"


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
    ("random actions never crash", check_random_actions),
    ("declared modalities match", check_modalities),
    ("tool schemas", check_tools),
    ("state round trip", check_state),
    ("async api", check_async),
]


def run_checks(target: str, make_env: Callable[[], Env]) -> CheckReport:
    report = CheckReport(target)
    try:
        probe = make_env()
    except Exception as err:
        report.results.append(CheckResult("construct", False, f"{type(err).__name__}: {err}"))
        return report
    if not isinstance(probe, Env):
        report.results.append(CheckResult("is a relax_gym.Env", False, f"got {type(probe).__name__}"))
        return report
    probe.close()
    for name, check in CHECKS:
        try:
            detail = check(make_env)
            if name == "gymnasium.check_env" and detail:
                report.warnings.append(detail)
                detail = "passed with warnings"
            report.results.append(CheckResult(name, True, detail))
        except CheckFailure as err:
            report.results.append(CheckResult(name, False, str(err)))
        except Exception as err:
            where = traceback.extract_tb(err.__traceback__)[-1]
            report.results.append(CheckResult(
                name, False, f"{type(err).__name__}: {err} (at {Path(where.filename).name}:{where.lineno})"))
    return report


def _import_target(target: str) -> list[tuple[str, Callable[[], Env]]]:
    """Resolves `ID`, `module:Class`, `path/to/file.py:Class` or `path/to/file.py` (its registered ids)."""
    module_part, _, attr = target.partition(":")
    before = set(list_envs())
    if module_part.endswith(".py"):
        path = Path(module_part).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {module_part}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_part)
    if attr:
        cls = getattr(module, attr, None)
        if cls is None:
            raise AttributeError(f"{module_part} has no attribute {attr!r}")
        return [(target, cls)]
    new_ids = sorted(set(list_envs()) - before)
    if not new_ids:
        raise LookupError(f"{module_part} registered no env; name a class with {module_part}:ClassName")
    return [(i, lambda i=i: make(i)) for i in new_ids]


def resolve(target: str) -> list[tuple[str, Callable[[], Env]]]:
    if target in list_envs():
        return [(target, lambda: make(target))]
    if ":" in target or target.endswith(".py"):
        return _import_target(target)
    make(target)  # raises UnknownEnvError with the closest ids
    raise AssertionError("unreachable")
