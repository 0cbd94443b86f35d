"""relax/Verifiers-v0: a verifiers taskset by its id, against the real verifiers package (the `verifiers` extra).

A taskset written here as verifiers' docs write one (a package exporting its `Taskset`, a `@vf.reward` on its
task) runs through the real rollout manager and agent proxy on the tiny model with a scripted engine: the right
reply scores the taskset's 1.0, a wrong one 0.0, and each trajectory holds the exact tokens of the one call. A
run starts one interception server however many envs the pool makes, the proxy's key reaches no process's
arguments or environment nor verifiers' logs, and no cloud runtime is taken.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest

import relax_gym
from relax_gym.cli import main
from relax_gym.engines.scripted import ScriptedEngine
from relax_gym.env.registration import register
from relax_gym.models import load_model
from relax_gym.rollout import RolloutLimits, RolloutManager
from relax_gym.rollout.agent_check import AGENT_CHECK

ENV_ID = "relax/Verifiers-v0"
TASKSET = "say-word-tasks"  # the module `say_word_tasks`, written below
WORDS = ["lantern", "meadow", "copper"]

SAY_WORD_TASKS = textwrap.dedent('''
    import verifiers.v1 as vf


    class SayData(vf.TaskData):
        word: str


    class SayTask(vf.Task[SayData]):
        @vf.reward
        async def exact(self, task: SayData, trace: vf.Trace) -> float:
            if task.word == "unscorable":
                raise ValueError("this reward cannot score")
            return float(trace.last_reply.strip() == task.word)


    class SayConfig(vf.TasksetConfig):
        words: list[str] = ["lantern"]


    class SayTaskset(vf.Taskset[SayTask, SayConfig]):
        def load(self):
            for word in self.config.words:
                yield SayTask(SayData(prompt=f"Say {word}.", word=word), self.config.task)


    __all__ = ["SayTaskset"]
''')


@pytest.fixture(scope="module")
def vf():
    return pytest.importorskip("verifiers.v1")  # absent without the `verifiers` extra


@pytest.fixture(scope="module")
def say_word_tasks(vf, tmp_path_factory):
    """The taskset as an installed package would be: a top-level module verifiers imports by the id."""
    folder = tmp_path_factory.mktemp("tasksets")
    (folder / "say_word_tasks.py").write_text(SAY_WORD_TASKS)
    sys.path.insert(0, str(folder))
    register("test/SayWord-v0", "relax_gym.envs.verifiers_env:VerifiersEnv", taskset=TASKSET, words=WORDS)
    yield "test/SayWord-v0"
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def said(turn: Any) -> str:
    """The scripted policy that says the asked word."""
    return re.search(r"Say (\w+)\.", turn.text).group(1)


def rollout(tiny: Any, env_id: str, policy: Callable[[Any], str], n: int, group: int = 1,
            keys: list[str] | None = None) -> list[Any]:
    manager = RolloutManager(ScriptedEngine(tiny, policy), tiny, limits=RolloutLimits(episode_timeout_s=120))

    async def go():
        try:
            trajectories = await manager.run(env_id, n, group)
            if keys is not None:
                keys.append((await manager.agent_server.get())[0].api_key)
            return trajectories
        finally:
            await manager.close()

    return asyncio.run(go())


def test_missing_package_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # makes `import verifiers.v1` fail
    with pytest.raises(ImportError, match=r"pip install 'relax-gym\[verifiers\]'"):
        relax_gym.make(ENV_ID)


def test_listing_does_not_need_the_package():
    assert ENV_ID in relax_gym.list_envs()
    assert relax_gym.describe(ENV_ID)["description"].startswith("A verifiers taskset by its id")


def test_the_right_reply_scores_the_tasksets_reward_with_the_exact_tokens(tiny, say_word_tasks):
    trajectories = rollout(tiny, say_word_tasks, said, n=3, group=2)
    assert len(trajectories) == 6
    assert {t.task for t in trajectories} <= {f"Say {w}." for w in WORDS}
    for traj in trajectories:
        assert traj.status == "completed" and traj.reward == 1.0, traj.status_reason
        assert traj.metrics["agent_calls"] == 1 and traj.metrics["agent_chains"] == 1
        generated = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
        assert generated == traj.token_ids[traj.prompt_len:]  # one call: all it generated is trained, nothing else
        word = traj.task.removeprefix("Say ").removesuffix(".")
        assert tiny.tokenizer.decode(generated, skip_special_tokens=True) == word
        assert traj.task in tiny.tokenizer.decode(traj.token_ids[:traj.prompt_len])


def test_a_wrong_reply_scores_zero(tiny, say_word_tasks):
    trajectories = rollout(tiny, say_word_tasks, lambda turn: "something else", n=2)
    assert [(t.status, t.reward) for t in trajectories] == [("completed", 0.0)] * 2
    assert all(sum(t.loss_mask) > 0 for t in trajectories)


def test_an_episode_verifiers_records_as_failed_fails_with_its_error(tiny, say_word_tasks):
    register("test/Unscorable-v0", "relax_gym.envs.verifiers_env:VerifiersEnv", taskset=TASKSET,
             words=["unscorable"])
    (traj,) = rollout(tiny, "test/Unscorable-v0", said, n=1)
    assert traj.status == "failed" and traj.reward == 0.0
    assert "verifiers episode failed: TaskError" in traj.status_reason
    assert "this reward cannot score" in traj.status_reason
    assert sum(traj.loss_mask) > 0  # the call was made and recorded; the scoring failed


def test_a_run_serves_one_interception_server_and_keeps_the_key_private(tiny, say_word_tasks, monkeypatch,
                                                                          caplog):
    from verifiers.v1.interception import InterceptionServer

    from relax_gym.envs import verifiers_env

    starts, spawned = [], []
    start, spawn = InterceptionServer.start, asyncio.create_subprocess_exec

    async def counted(self):
        starts.append(self)
        await start(self)

    async def recorded(*argv, **kwargs):
        spawned.append((argv, kwargs.get("env") or {}))
        return await spawn(*argv, **kwargs)

    monkeypatch.setattr(InterceptionServer, "start", counted)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", recorded)
    caplog.set_level(logging.DEBUG, logger="verifiers")
    keys: list[str] = []
    before = set(verifiers_env._RUNNERS)  # another test's envs (a check's, never closed) may hold theirs
    trajectories = rollout(tiny, say_word_tasks, said, n=4, group=2, keys=keys)  # 8 episodes, 8 at a time
    assert [t.reward for t in trajectories] == [1.0] * 8
    assert len(starts) == 1 and set(verifiers_env._RUNNERS) == before  # one server; gone once the run's envs closed
    (key,) = keys
    assert key not in json.dumps([argv for argv, _ in spawned]) and key not in json.dumps([e for _, e in spawned])
    assert key not in os.environ.values() and key not in caplog.text


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("uv") is None, reason="verifiers' null harness is a uv script")
def test_verifiers_own_chat_program_gets_the_interception_secret_not_the_proxy_key(tiny, say_word_tasks,
                                                                                    monkeypatch):
    spawned = []
    spawn = asyncio.create_subprocess_exec

    async def recorded(*argv, **kwargs):
        spawned.append((argv, kwargs.get("env") or {}))
        return await spawn(*argv, **kwargs)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recorded)
    register("test/SayWordNull-v0", "relax_gym.envs.verifiers_env:VerifiersEnv", taskset=TASKSET, harness="null",
             words=WORDS)
    keys: list[str] = []
    trajectories = rollout(tiny, "test/SayWordNull-v0", said, n=2, keys=keys)
    assert [(t.status, t.reward) for t in trajectories] == [("completed", 1.0)] * 2, trajectories[0].status_reason
    (key,) = keys
    programs = [argv for argv, _ in spawned if any(str(a).startswith("--api-key=") for a in argv)]
    assert len(programs) == 2  # one chat program an episode, each with a secret of the interception's
    assert key not in json.dumps([argv for argv, _ in spawned]) and key not in json.dumps([e for _, e in spawned])


def test_relax_gym_check_runs_the_default_taskset_through_the_agent(vf, capsys):
    assert main(["check", ENV_ID, "--json"]) == 0, capsys.readouterr().out
    (report,) = json.loads(capsys.readouterr().out)
    agent = {r["name"]: r for r in report["results"]}[AGENT_CHECK]
    assert agent["status"] == "passed" and agent["detail"].startswith("1 model call over 1 chain, reward 0")


def test_cloud_runtimes_are_refused_and_taskset_kwargs_are_checked(vf, say_word_tasks):
    with pytest.raises(ValueError, match="runtime must be local"):
        relax_gym.make(ENV_ID, runtime="prime")
    with pytest.raises(ValueError, match="words"):
        relax_gym.make(ENV_ID, taskset=TASKSET, words="not a list")
    env = relax_gym.make(ENV_ID, taskset=TASKSET, words=WORDS, size=2)
    try:
        obs, info = env.reset(seed=3)
        assert info["task"] in {"Say lantern.", "Say meadow."}  # size=2: the first two rows
        assert obs[0]["content"][0]["text"] == info["task"]
    finally:
        env.close()
