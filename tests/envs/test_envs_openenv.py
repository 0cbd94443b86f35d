"""relax/OpenEnv-v0 against real OpenEnv servers: small envs (tests/support/openenv_servers.py) served on loopback by
OpenEnv's own app factory (`openenv.core.env_server.create_fastapi_app`) under uvicorn, in OpenEnv's own venv, the
wire protocol untouched."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.engines import free_port

import relax_gym
from relax_gym.cli import main
from relax_gym.env.conformance import run_checks, tool_call
from relax_gym.envs.openenv import observation_field_of, render_observation

ENV_ID = "relax/OpenEnv-v0"
ROOT = Path(__file__).resolve().parents[2]
MAX_ATTEMPTS = 7  # as in support/openenv_servers.py: bisection finds any number in 1..100 in 7 guesses
FEEDBACK = re.compile(r"You said (\d+): (higher|lower)")


def test_missing_websockets_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "websockets.sync.client", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install 'relax-gym\[openenv\]'"):
        relax_gym.make(ENV_ID, url="http://127.0.0.1:9")


def test_listing_does_not_need_a_server():
    assert ENV_ID in relax_gym.list_envs()
    assert relax_gym.describe(ENV_ID)["description"].startswith("An OpenEnv server's env")


def test_a_message_list_is_shown_rather_than_a_prompt_string():
    """OpenEnv's TextArena server: `prompt` is the rules alone, the game's messages (history included) are a list."""
    schema = {"properties": {"prompt": {"type": "string"}, "messages": {"type": "array", "items": {}},
                             "current_player_id": {"type": "integer"}, "done": {"type": "boolean"}}}
    assert observation_field_of(schema) == "messages"
    assert observation_field_of({"properties": {"prompt": {"type": "string"}, "turn": {"type": "integer"}}}) == "prompt"
    observation = {"prompt": "rules", "messages": [{"sender_id": -1, "content": "[GAME] rules", "category": "PROMPT"},
                                                   {"sender_id": 0, "content": "[5]", "category": "ACTION"}]}
    assert render_observation(observation, "messages") == "[GAME] rules\n[5]"
    assert render_observation({"turn": 2, "board": [1, 2], "metadata": {"x": 1}}, None) == "turn: 2\nboard: [1, 2]"


# --- the servers (tests/support/openenv_servers.py) ----------------------------------------------------------------
#: OpenEnv's own venv (scripts/setup_openenv_venv.sh): openenv 0.10 needs mcp<2, which the verifiers extra in .venv
#: cannot share, so its servers run as processes of that venv, as an OpenEnv server runs in a container of its own
OPENENV_PYTHON = Path(os.environ.get("RELAX_GYM_OPENENV_PYTHON") or ROOT / ".venv-openenv" / "bin" / "python")
SERVERS = ROOT / "tests" / "support" / "openenv_servers.py"


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., str]]:
    """`serve(name, action=None, limit=16)`: the URL of a running server of `openenv_servers.APPS[name]` (its action
    class replaced by `action`, one of that module's Action classes, by name), one process per arguments."""
    if not OPENENV_PYTHON.is_file():
        pytest.fail(f"no {OPENENV_PYTHON}: run `bash scripts/setup_openenv_venv.sh` (scripts/test.sh does)")
    running: dict[tuple, str] = {}
    processes: list[subprocess.Popen] = []

    def start(name: str, action: str | None = None, limit: int = 16) -> str:
        if (name, action, limit) not in running:
            proc = subprocess.Popen([str(OPENENV_PYTHON), str(SERVERS), name, str(free_port()), action or "-",
                                     str(limit)], stdout=subprocess.PIPE, text=True)
            processes.append(proc)
            url = proc.stdout.readline().strip() if proc.stdout else ""
            if not url.startswith("http"):
                proc.kill()
                pytest.fail(f"the OpenEnv server {name} did not start (exit {proc.wait()})")
            running[name, action, limit] = url
        return running[name, action, limit]

    try:
        yield start
    finally:
        for proc in processes:
            proc.terminate()
            proc.wait(10)


def text(obs: list[dict[str, Any]]) -> str:
    return "\n".join(part["text"] for m in obs for part in m["content"])


def bisect(seen: list[str], low: int = 1, high: int = 100) -> int:
    """The next guess, from every higher/lower line seen so far."""
    for said, way in FEEDBACK.findall("\n".join(seen)):
        if way == "higher":
            low = max(low, int(said) + 1)
        else:
            high = min(high, int(said) - 1)
    return (low + high) // 2


# --- the tests -----------------------------------------------------------------------------------------------------
def test_made_by_id_with_a_url_the_action_field_from_the_schema(serve):
    env = relax_gym.make(ENV_ID, url=serve("guess"))
    assert (env.action_field, env.observation_field, env.tool_schemas) == ("guess", "transcript", [])
    obs, info = env.reset(seed=3)
    assert text(obs).startswith("Guess my number") and info["openenv_seed"] == 3
    env.close()


def test_a_bisecting_policy_wins_reward_one(serve):
    env = relax_gym.make(ENV_ID, url=serve("guess"))
    for seed in (0, 1, 2):
        obs, _ = env.reset(seed=seed)
        seen, done, reward, turns = [text(obs)], False, 0.0, 0
        while not done:
            obs, reward, done, truncated, info = env.step(str(bisect(seen)))
            seen.append(text(obs))
            turns += 1
            assert not truncated and json.dumps(info)
        assert reward == 1.0 and "correct" in seen[-1] and turns <= MAX_ATTEMPTS
        assert re.search(r"You said (\d+): correct", seen[-1])[1] == str(random.Random(seed).randint(1, 100))
    env.close()


def test_cumulative_observations_become_deltas(serve):
    url = serve("guess")
    env = relax_gym.make(ENV_ID, url=url)
    env.reset(seed=5)
    first, *_ = env.step("50")
    second, *_ = env.step("hello")
    assert re.fullmatch(r"You said 50: (higher|lower)\.\n?", text(first))
    assert text(second).strip() == "not a number."  # only what is new: neither the rules nor the first guess
    whole = relax_gym.make(ENV_ID, url=url, deltas=False)
    whole.reset(seed=5)
    whole.step("50")
    again, *_ = whole.step("hello")
    assert text(again).startswith("Guess my number") and "You said 50" in text(again)
    env.close()
    whole.close()


def test_the_action_field_must_be_named_when_the_schema_has_not_exactly_one(serve):
    with pytest.raises(ValueError, match=r"0 required string fields.*guess \(string\), note \(string\).*"
                                         r"action_field=NAME"):
        relax_gym.make(ENV_ID, url=serve("guess", "NotedAction"))
    with pytest.raises(ValueError, match=r"2 required string fields.*action_field=NAME"):
        relax_gym.make(ENV_ID, url=serve("guess", "TwoRequiredAction"))
    with pytest.raises(ValueError, match=r"has no field 'answer'; its fields: guess \(string\), note \(string\)"):
        relax_gym.make(ENV_ID, url=serve("guess", "NotedAction"), action_field="answer")
    env = relax_gym.make(ENV_ID, url=serve("guess", "NotedAction"), action_field="guess")
    env.reset(seed=1)
    obs, *_ = env.step(str(random.Random(1).randint(1, 100)))
    assert "correct" in text(obs)
    env.close()


def test_the_check_passes(capsys, serve):
    assert main(["check", ENV_ID, "--env-arg", f"url={serve('guess')}", "--json"]) == 0, capsys.readouterr().out
    (report,) = json.loads(capsys.readouterr().out)
    assert report["passed"], report
    seeded = next(r for r in report["results"] if r["name"] == "seeded replay in fresh envs")
    assert seeded["status"] == "passed" and "random actions" in seeded["detail"]


def test_a_server_that_ignores_the_reset_seed_fails_the_seeded_replay(serve):
    """The first observation does not show the number, so reset alone looks deterministic; the number told when the
    guesses run out (random text never wins) differs between two fresh envs given the same seed."""
    (report,) = [run_checks(ENV_ID, lambda: relax_gym.make(ENV_ID, url=serve("seedless")))]
    status = {r.name: r for r in report.results}
    assert status["reset is deterministic per seed"].passed
    seeded = status["seeded replay in fresh envs"]
    assert seeded.status == "failed" and "the seed does not name the whole task" in seeded.detail, seeded
    assert not report.passed


def test_a_session_limit_below_the_runs_concurrency_is_one_clear_error(serve):
    url = serve("guess", limit=1)
    first, second = relax_gym.make(ENV_ID, url=url), relax_gym.make(ENV_ID, url=url)
    first.reset(seed=0)
    with pytest.raises(relax_gym.envs.openenv.OpenEnvCapacityError,
                       match=r"allows 1 concurrent sessions \(its max_concurrent_envs\).*rollout.concurrency <= 1"):
        second.reset(seed=0)
    assert second.max_sessions == 1
    first.close()  # frees the server's one session before it returns
    second.reset(seed=0)
    second.close()
    first.check_capacity(1)
    with pytest.raises(relax_gym.envs.openenv.OpenEnvCapacityError, match=r"needs 2 \(rollout.concurrency\)"):
        first.check_capacity(2)
    error = relax_gym.envs.openenv.OpenEnvCapacityError(url, 1, 4)
    assert "\n" not in str(error)


def test_a_run_above_the_servers_session_limit_stops_at_its_start(serve, tmp_path, capsys):
    """`relax-gym rollout` opens rollout.concurrency sessions before any episode: one line, exit 2."""
    url = serve("guess", limit=2)
    args = ["rollout", "--model", "tiny", "--env", ENV_ID, "--env-arg", f"url={url}", "-n", "1",
            "--out", str(tmp_path / "out.jsonl")]
    assert main([*args, "--concurrency", "3"]) == 2
    said = capsys.readouterr()
    assert "allows 2 concurrent sessions" in said.out and "needs 3 (rollout.concurrency)" in said.out
    assert "Traceback" not in said.out + said.err


def test_mcp_tools_are_offered_and_the_models_calls_run_on_the_session(serve):
    url = serve("tools")
    env = relax_gym.make(ENV_ID, url=url)
    assert env.tools_only and env.action_field is None and env.metadata["tools"] == ("guess",)
    (schema,) = env.tool_schemas
    assert schema["function"]["parameters"]["properties"]["number"]["type"] == "integer"
    obs, _ = env.reset(seed=4)
    assert "Call the guess tool" in text(obs)
    seen, done, reward = [text(obs)], False, 0.0
    while not done:
        obs, reward, done, _, _ = env.step(tool_call("guess", {"number": bisect(seen)}))
        assert [m["role"] for m in obs] == ["tool"] and obs[0]["name"] == "guess"
        seen.append(text(obs))
    assert reward == 1.0 and "correct" in seen[-1]
    env.reset(seed=4)
    obs, reward, done, _, info = env.step("I give up.")  # a reply without a call ends a tools-only episode
    assert (obs, reward, done, info["ended_by"]) == ([], 0.0, True, "reply without a tool call")
    env.reset(seed=4)
    obs, *_ = env.step('<tool_call>{"name": "guess", "arguments": {"number": "many"}}</tool_call>')
    assert text(obs).startswith("Error")  # the server's validation error, for the model to read
    env.close()


def test_the_check_passes_on_an_mcp_env(capsys, serve):
    url = serve("tools")
    assert main(["check", ENV_ID, "--env-arg", f"url={url}", "--json"]) == 0, capsys.readouterr().out
    (report,) = json.loads(capsys.readouterr().out)
    seeded = next(r for r in report["results"] if r["name"] == "seeded replay in fresh envs")
    assert report["passed"] and "synthesised tool calls" in seeded["detail"], report


def test_mcp_tools_beside_a_text_action_are_called_on_the_session(capsys, serve):
    """An env with a text Action and MCP tools: calls go to the session's MCP server (`tools/call` on the
    websocket), a reply without one is the action."""
    env = relax_gym.make(ENV_ID, url=serve("hinted"))
    assert not env.tools_only and (env.action_field, env.metadata["tools"]) == ("guess", ("hint",))
    env.reset(seed=8)
    low, high, reward, steps = 1, 100, 0.0, 0
    while True:
        obs, reward, done, _, _ = env.step(tool_call("hint", {"number": (low + high) // 2}))
        assert (reward, done, [m["role"] for m in obs]) == (0.0, False, ["tool"])
        steps += 1
        if text(obs) == "that's it":
            break
        low, high = ((low + high) // 2 + 1, high) if text(obs) == "higher" else (low, (low + high) // 2 - 1)
    obs, reward, done, _, _ = env.step(str((low + high) // 2))
    assert (reward, done) == (1.0, True) and "correct" in text(obs) and steps > 1
    env.close()
    assert main(["check", ENV_ID, "--env-arg", f"url={serve('hinted')}", "--json"]) == 0, capsys.readouterr().out


def test_rollout_with_a_scripted_bisecting_player(serve):
    """The whole path: the rollout manager (episodes in threads, a GRPO group of one seed), the tiny model's chat
    template and tokens, a player reading the deltas."""
    from relax_gym.engines import ScriptedEngine, ScriptedTurn
    from relax_gym.models import load_model
    from relax_gym.rollout import RolloutManager

    def reply(turn: ScriptedTurn) -> str:
        return str(bisect([turn.text]))

    loaded = load_model("tiny")
    manager = RolloutManager(ScriptedEngine(loaded, reply), loaded)
    trajs = asyncio.run(manager.run(ENV_ID, n_tasks=2, group_size=2, seed=10, env_kwargs={"url": serve("guess")}))
    assert [(t.status, t.reward) for t in trajs] == [("completed", 1.0)] * 4
    assert [t.infos[-1]["openenv_seed"] for t in trajs] == [10, 10, 11, 11]
