"""Envs served over HTTP: `relax-gym env-server` (a real subprocess on loopback) and `RemoteEnv`.

A served env passes the same conformance checks as an in-process one, gives the rollout manager the same
trajectories for the same seeds (multi-turn, and with images and audio), refuses requests without its API key,
and when the server dies mid-rollout its episodes end `failed` with the reason while the run goes on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from support.engine_doubles import EndsEachTurn

from relax_gym import RemoteEnv, RemoteEnvError
from relax_gym.engines import EmbeddedEngine, SamplingParams
from relax_gym.env.conformance import run_checks
from relax_gym.models import load_model
from relax_gym.rollout import RolloutLimits, RolloutManager

KEY = "remote-env-test-key"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def env_server(env_id: str, *args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`relax-gym env-server ENV` on a free loopback port, its API key `KEY`; the URL once it answers."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "relax_gym.cli", "env-server", env_id, "--port", str(port), *args],
                            env={**os.environ, "RELAX_GYM_ENV_KEY": KEY}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"env-server did not start:\n{proc.communicate()[0][-3000:]}")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def _rollout(loaded, env_id: str, env_kwargs: dict, engine=None, n: int = 3, group: int = 2):
    engine = engine or EndsEachTurn(EmbeddedEngine(loaded), loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    manager = RolloutManager(engine, loaded, sampling=SamplingParams(max_new_tokens=6), sampling_seed=0,
                             limits=RolloutLimits(max_turns=4))
    return asyncio.run(manager.run(env_id, n, group, env_kwargs=env_kwargs))


def test_a_served_env_gives_the_in_process_trajectories_and_passes_the_checks(tiny):
    with env_server("relax/GuessNumber-v0") as (url, _):
        report = run_checks("relax/Remote-v0", lambda: RemoteEnv(url, api_key=KEY))
        assert report.passed, report
        remote = _rollout(tiny, "relax/Remote-v0", {"url": url, "api_key": KEY})
    local = _rollout(tiny, "relax/GuessNumber-v0", {})
    assert any(t.metrics["turns"] > 1 for t in local)
    for a, b in zip(local, remote, strict=True):
        assert (a.token_ids, a.loss_mask, a.reward, a.step_rewards, a.status) == \
            (b.token_ids, b.loss_mask, b.reward, b.step_rewards, b.status)


def test_a_served_env_with_images_and_audio_renders_the_same_prompt():
    omni = load_model("tiny-omni")
    with env_server("relax/AVQA-v0") as (url, _):
        remote = RemoteEnv(url, api_key=KEY)
        assert remote.metadata["modalities"] == ("text", "image", "audio")
        from relax_gym import make
        from relax_gym.models import processor_inputs

        for seed in range(2):
            served, _ = remote.reset(seed=seed)
            local, _ = make("relax/AVQA-v0").reset(seed=seed)
            assert processor_inputs(omni, served)["input_ids"].tolist() == \
                processor_inputs(omni, local)["input_ids"].tolist()
            served_audio = next(p for p in served[0]["content"] if p["type"] == "audio")["audio"]
            local_audio = next(p for p in local[0]["content"] if p["type"] == "audio")["audio"]
            assert (served_audio == local_audio).all()  # float WAV on the wire: exact
        remote.close()


def test_the_api_key_is_required_and_a_dead_server_fails_its_episodes_while_the_run_goes_on(tiny):
    with env_server("relax/GuessNumber-v0") as (url, proc):
        assert httpx.post(f"{url}/sessions", json={}).status_code == 401
        with pytest.raises(RemoteEnvError, match="answered 401"):
            RemoteEnv(url, api_key="wrong")

        def kill() -> None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

        end = tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
        engine = EndsEachTurn(EmbeddedEngine(tiny), end, after=5, on_call=kill)
        trajs = _rollout(tiny, "relax/Remote-v0", {"url": url, "api_key": KEY}, engine=engine, n=4, group=2)
    assert len(trajs) == 8
    failed = [t for t in trajs if t.status == "failed"]
    assert failed and all("unreachable" in t.status_reason and url in t.status_reason for t in failed)


def test_idle_sessions_are_closed_and_too_many_are_refused():
    from starlette.testclient import TestClient

    from relax_gym.env.env_server import create_app

    app = create_app("relax/GuessNumber-v0", api_key=KEY, max_sessions=2, session_timeout_s=0.05)
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app) as client:
        first = client.post("/sessions", json={}, headers=auth).json()["session_id"]
        client.post("/sessions", json={}, headers=auth)
        refused = client.post("/sessions", json={}, headers=auth)
        assert refused.status_code == 503 and "max_sessions" in refused.json()["error"]["message"]
        time.sleep(0.1)  # longer than the timeout: both sessions are idle
        app.app.state.sessions.close_idle()  # what the server's sweep does (if it has not already)
        assert not app.app.state.sessions.sessions
        gone = client.post(f"/sessions/{first}/reset", json={"seed": 0}, headers=auth)
        assert gone.status_code == 404 and "timed out" in gone.json()["error"]["message"]
        unknown = client.post("/sessions", json={"seed": 1}, headers=auth)  # no such field
        assert unknown.status_code == 400 and "seed: Extra inputs" in unknown.json()["error"]["message"]


def test_an_env_that_runs_code_is_served_only_with_a_container_sandbox(monkeypatch):
    """No fallback to a subprocess on the server's host for a client's code: without a container the server
    refuses to start, naming the opt-in; with one, every session is made with `require_container=True`."""
    import relax_gym.sandbox
    from relax_gym.env.env_server import create_app
    from relax_gym.errors import StartupError

    monkeypatch.setattr(relax_gym.sandbox, "container_unavailable", lambda config: "no engine answered")
    monkeypatch.setattr("relax_gym.envs.math.container_unavailable", lambda config: None)  # no warning here
    with pytest.raises(StartupError, match=r"runs model-written code.*no engine answered.*--allow-unsandboxed-code"):
        create_app("relax/MathTool-v0", api_key=KEY)
    allowed = create_app("relax/MathTool-v0", api_key=KEY, allow_unsandboxed_code=True).app.state.sessions
    assert "require_container" not in allowed.env_kwargs  # the operator took the risk by name
    allowed.close_all()
    monkeypatch.setattr(relax_gym.sandbox, "container_unavailable", lambda config: None)
    sessions = create_app("relax/MathTool-v0", api_key=KEY).app.state.sessions
    assert sessions.env_kwargs["require_container"] is True and sessions.probe.sandbox_config.require_container
    sessions.close_all()
    plain = create_app("relax/GuessNumber-v0", api_key=KEY).app.state.sessions  # no code: nothing asked
    assert "require_container" not in plain.env_kwargs
    plain.close_all()


def test_a_clients_mistakes_are_4xx_and_its_session_survives_them():
    """A seed out of range, options the env refuses, a step out of order: the client's, answered with one line,
    and the session is still there to reset; only the env's own failure ends an episode."""
    from starlette.testclient import TestClient

    from relax_gym.env.env_server import create_app

    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(create_app("relax/Math-v0", api_key=KEY)) as client:
        sid = client.post("/sessions", json={}, headers=auth).json()["session_id"]

        def call(route: str, body: dict) -> httpx.Response:
            return client.post(f"/sessions/{sid}/{route}", json=body, headers=auth)

        early = call("step", {"action": "\\boxed{4}"})
        assert early.status_code == 409 and "call reset() before step()" in early.json()["error"]["message"]
        negative = call("reset", {"seed": -1})
        assert negative.status_code == 400 and negative.json()["error"]["message"].startswith("seed:")
        refused = call("reset", {"seed": 0, "options": {"index": -1}})
        assert refused.status_code == 400 and "options['index'] must be an int" in refused.json()["error"]["message"]
        assert call("reset", {"seed": 0}).status_code == 200  # the same session, still open
        assert call("step", {"action": "\\boxed{4}"}).json()["terminated"]
        assert call("step", {"action": "\\boxed{4}"}).status_code == 409  # after the end
        assert call("reset", {"seed": 1}).status_code == 200
