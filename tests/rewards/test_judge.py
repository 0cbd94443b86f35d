"""OpenAI's chat completions on `relax-gym serve` (driven by the real `openai` client), and judge rewards
(`JudgeReward`, `relax/JudgedQA-v0`): a score parsed from the judge's reply, `timeout` and `error` reported as
such, never a silent 0."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from support.engines import KEY, serving

from relax_gym import make
from relax_gym.engines import EmbeddedEngine, SamplingParams
from relax_gym.engines.openai_api import ChatCompletionIn, chat_completion
from relax_gym.engines.scripted import ScriptedEngine
from relax_gym.env.conformance import run_checks
from relax_gym.models import load_model, render_ids
from relax_gym.rewards import JudgeReward
from relax_gym.rollout import RolloutLimits, RolloutManager
from relax_gym.tools.formats import tool_format_of


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module")
def judge_server():
    with serving(load_model("tiny")) as (url, _):
        yield url


def test_the_openai_client_talks_to_relax_gym_serve(tiny, judge_server):
    client = openai.OpenAI(base_url=f"{judge_server}/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8,
                                           logprobs=True, n=2)

    async def local():
        engine = EmbeddedEngine(load_model("tiny"))
        try:
            from relax_gym.engines.base import GenerateRequest
            return await engine.generate(GenerateRequest(render_ids(tiny, [{"role": "user", "content": [
                {"type": "text", "text": "What is 2+2?"}]}]), SamplingParams(temperature=0, max_new_tokens=8)))
        finally:
            await engine.close()

    out = asyncio.run(local())
    assert len(reply.choices) == 2 and reply.choices[0].message.content == tiny.decode(out.output_ids,
                                                                                       skip_special_tokens=True)
    assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx(out.logprobs, abs=1e-5)
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8,
                                                 stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{judge_server}/v1", api_key="wrong").models.list()


def test_tool_calls_come_back_in_openais_shape(tiny):
    fmt = tool_format_of(tiny)
    engine = ScriptedEngine(tiny, [fmt.write_calls([("get_weather", {"city": "Paris"})], "Let me look.")])
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}
    body = ChatCompletionIn(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[weather])
    answer = asyncio.run(chat_completion(engine, tiny, body, tool_format=fmt, decode_image=None, model_name="tiny"))
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "get_weather",
                                                               "arguments": '{"city": "Paris"}'}
    follow = ChatCompletionIn(messages=[  # the call and its result go back in as OpenAI clients send them
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 18}'}], tools=[weather])
    seen = []

    def reply(turn):
        seen.append(turn.text)
        return "It is 18 C."

    again = asyncio.run(chat_completion(ScriptedEngine(tiny, reply), tiny, follow, tool_format=fmt,
                                        decode_image=None, model_name="tiny"))
    assert again["choices"][0]["message"]["content"] == "It is 18 C."
    assert '<tool_response>\n{"temp_c": 18}\n</tool_response>' in seen[0]  # the result reached the template


def test_a_judge_scores_and_says_when_it_failed(tiny, judge_server):
    scripted = JudgeReward(engine=ScriptedEngine(tiny, ["The answer is right. <score>7</score>"]), model=tiny)
    result = scripted("What is 2+2?", "4", "4")
    assert (result.score, result.status, result.extracted) == (0.7, "ok", "7.0")

    served = JudgeReward(judge_server, api_key=KEY, max_tokens=8, retries=0)  # a random model writes no score
    result = served("What is 2+2?", "4")
    assert result.status == "error" and "no score" in result.detail

    silent = socket.socket()  # accepts connections and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    try:
        slow = JudgeReward(f"http://127.0.0.1:{port}", timeout_s=0.3, retries=1)
        result = slow("What is 2+2?", "4")
        assert (result.score, result.status) == (0.0, "timeout") and "0.3 s, 2 attempts" in result.detail
        refused = JudgeReward("http://127.0.0.1:9", timeout_s=2, retries=0)  # nothing listens on port 9
        assert refused("q", "a").status == "error"
    finally:
        silent.close()


def test_a_question_too_long_for_the_judge_is_refused_before_tokenizing_and_not_retried(tiny, judge_server):
    """A policy's answer of megabytes must not cost the judge a tokenizer pass (or three, with retries)."""
    huge = "x " * 2_000_000
    tokenized: list[int] = []
    counted = type(tiny.tokenizer).__call__

    class Counting(type(tiny.tokenizer)):  # type: ignore[misc]
        def __call__(self, *args, **kwargs):
            tokenized.append(1)
            return counted(self, *args, **kwargs)

    engine = EmbeddedEngine(tiny)
    original = type(tiny.tokenizer)
    tiny.tokenizer.__class__ = Counting
    try:
        result = JudgeReward(engine=engine, model=tiny, retries=2)("What is 2+2?", huge)
    finally:
        tiny.tokenizer.__class__ = original
        asyncio.run(engine.close())
    assert result.status == "error" and "characters, more than its" in result.detail and not tokenized

    served = JudgeReward(judge_server, api_key=KEY, retries=2)("What is 2+2?", huge)
    assert served.status == "error" and "refused the question (400)" in served.detail, served.detail


def test_judged_qa_rolls_out_with_a_served_judge_and_reports_its_status(tiny, judge_server):
    judge = {"url": judge_server, "api_key": KEY, "max_tokens": 8, "retries": 0}
    report = run_checks("relax/JudgedQA-v0", lambda: make("relax/JudgedQA-v0", judge=judge))
    assert report.passed, report
    policy = ScriptedEngine(tiny, ["Blue light scatters more than red."])  # ends its turn: graded by the judge
    manager = RolloutManager(policy, tiny, limits=RolloutLimits(max_turns=1))
    trajs = asyncio.run(manager.run("relax/JudgedQA-v0", 2, 2, env_kwargs={"judge": judge}))
    graded = [t for t in trajs if t.status == "completed"]
    assert graded and all(t.metrics["reward_status"] == "error" and t.reward == 0.0 for t in graded)
    with pytest.raises(ValueError, match="needs a judge"):
        make("relax/JudgedQA-v0")
    # the envs of a run share one judge (one event loop, client and concurrency bound), not one each
    assert make("relax/JudgedQA-v0", judge=judge).judge is make("relax/JudgedQA-v0", judge=judge).judge


def _judged_run(tmp_path, judge: dict, steps: int = 2) -> int:
    """Two steps of the quickstart's warm-started policy on judged questions in the quickstart's own format (so
    it answers in a few tokens and ends its turn)."""
    from relax_gym.cli import main

    root = Path(__file__).resolve().parents[2]
    data = tmp_path / "questions.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"question": f"What is {a} + {b}? Reply with just the integer.",
                                        "reference": str(a + b)}) + "\n" for a, b in ((2, 3), (4, 1), (6, 2))))
    kwargs = json.dumps({"judge": judge, "data_path": str(data)})
    envs = f"envs=[{{id: relax/JudgedQA-v0, kwargs: {kwargs}}}]"
    return main(["train", str(root / "examples" / "configs" / "quickstart.yaml"), f"run_dir={tmp_path / 'run'}",
                 envs, f"trainer.total_steps={steps}", "trainer.checkpoint_every=100", "trainer.eval_every=0",
                 "rollout.groups_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8"])


def test_a_config_trains_on_a_served_judges_scores_and_a_dead_judge_stops_the_run(tmp_path, capsys):
    """The warm-started policy answers in a few tokens, so its episodes complete and the judge grades them. The
    judge is a second tiny model served by `relax-gym serve`'s app: the same warm start, which answers any prompt
    with digits, so the test reads its first digit as the score (pattern, max_score): the plumbing is the point.
    A judge that never answers makes every reward `timeout` and stops the run with that, not training on zeros
    (one that is not there at all, or refuses the key, stops it at start-up: the next test)."""
    judge_model = load_model(str(Path(__file__).resolve().parents[2] / "examples" / "checkpoints" /
                                 "tiny-arithmetic"))
    with serving(judge_model) as (url, _):
        scored = {"url": url, "api_key": KEY, "pattern": r"(\d)", "max_score": 9, "max_tokens": 8, "retries": 0}
        assert _judged_run(tmp_path / "ok", scored) == 0
    steps = [json.loads(line) for line in (tmp_path / "ok" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and any(s["reward_mean"] > 0 for s in steps)
    with _lists_models_never_judges() as url:
        dead = {"url": url, "timeout_s": 0.3, "retries": 0}
        assert _judged_run(tmp_path / "dead", dead) != 0
    assert "no reward of step 1 could be computed ({'timeout': 4}" in capsys.readouterr().out.replace("\n", " ")


@contextlib.contextmanager
def _lists_models_never_judges() -> Iterator[str]:
    """A server that passes the judge's start-up probe (`/v1/models`) and then never answers a question."""
    release = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"object": "list", "data": []}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            release.wait(30)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_a_judge_that_refuses_the_key_or_is_not_there_stops_a_run_at_start_up(tmp_path, judge_server, capsys,
                                                                                monkeypatch):
    monkeypatch.delenv("RELAX_GYM_JUDGE_KEY", raising=False)
    monkeypatch.setenv("RELAX_GYM_API_KEY", KEY)  # the judge's server would take it, but an engine's key stays home
    unset = r"refused no key \(none given, \$RELAX_GYM_JUDGE_KEY unset\): it answered 401"
    with pytest.raises(ValueError, match=unset):
        make("relax/JudgedQA-v0", judge={"url": judge_server, "timeout_s": 5})
    unkeyed = JudgeReward(judge_server, retries=3)
    result = unkeyed("What is 2+2?", "4")  # not asked again: a refused key stays refused
    assert result.status == "error" and "answered 401" in result.detail and "failed" not in result.detail
    assert _judged_run(tmp_path / "refused", {"url": judge_server, "api_key": "wrong"}) == 2
    out = capsys.readouterr().out.replace("\n", " ")
    assert "refused the key given: it answered 401" in out and "Traceback" not in out
    with pytest.raises(ValueError, match=r"no judge answers at http://127\.0\.0\.1:9"):
        make("relax/JudgedQA-v0", judge={"url": "http://127.0.0.1:9", "timeout_s": 5})


def test_an_episode_whose_reward_failed_is_left_out_of_its_groups_advantages():
    from relax_gym.trainer.loop import group_to_samples
    from relax_gym.trajectory import Trajectory

    def episode(reward: float, **metrics) -> Trajectory:
        return Trajectory(token_ids=[1, 2, 3], prompt_len=1, loss_mask=[0, 1, 1], rollout_logprobs=[0.0, -0.1, -0.1],
                          versions=[0, 0, 0], reward=reward, step_rewards=[reward], status="completed",
                          status_reason="", group_id="g", env_id="e", task="t", metrics=metrics)

    samples = group_to_samples([episode(1.0), episode(0.0), episode(0.0, reward_status="timeout")], False)
    assert [s.advantage for s in samples] == [0.5, -0.5]  # the unjudged 0 neither counts nor moves the baseline
