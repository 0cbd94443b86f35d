"""Agents written against the `openai` package, trained through the agent proxy (`relax_gym.env.agent_env`).

With a scripted policy that calls the weather tool and then answers, the example agent's episode is one chain:
the trained tokens are exactly what the engine generated, the tool result and the glue around it are masked,
and the agent's reward is the trajectory's. An agent that rewrites its history makes a second chain; one that
raises fails its episode with why. The example registers, passes `relax-gym check`, rolls out and trains.
A vision agent's data-URL images reach the processor; a MoE agent's samples keep their routed experts, and a
seeded run's agent episodes repeat themselves. An agent that never stops is ended `truncated` by the run's
turn and token limits.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.engine_doubles import EndsEachTurn

from relax_gym.cli import main
from relax_gym.engines import EmbeddedEngine, SamplingParams
from relax_gym.engines.scripted import ScriptedEngine
from relax_gym.env.agent_env import AgentEnv
from relax_gym.env.registration import register
from relax_gym.models import load_model
from relax_gym.rollout import RolloutLimits, RolloutManager
from relax_gym.tools.formats import tool_format_of

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "openai_agent.py"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module")
def example():
    namespace: dict = {}
    exec(compile(EXAMPLE.read_text(), str(EXAMPLE), "exec"), namespace)  # registers example/OpenAIAgent-v0
    return namespace


def _run(loaded, engine, env_id: str, n: int = 2, group: int = 2, **manager_kwargs):
    manager = RolloutManager(engine, loaded, limits=RolloutLimits(episode_timeout_s=60), **manager_kwargs)

    async def go():
        try:
            return await manager.run(env_id, n, group)
        finally:
            await manager.close()

    return asyncio.run(go())


def test_a_tool_agent_episode_is_one_chain_with_exact_tokens_and_masked_tool_results(tiny, example):
    fmt = tool_format_of(tiny)

    def policy(turn):  # call the tool for the city the agent asked about, then state its temperature
        if turn.turn == 0:
            city = next(c for c in example["WEATHER"] if c in turn.text)
            return fmt.write_calls([("get_weather", {"city": city})])
        temp = json.loads(turn.text.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0])["temp_c"]
        return f"It is {temp} degrees."

    engine = ScriptedEngine(tiny, policy, logprob=-0.5)
    trajs = _run(tiny, engine, "example/OpenAIAgent-v0")
    assert len(trajs) == 4 and all(t.status == "completed" and t.reward == 1.0 for t in trajs)
    for traj in trajs:
        assert traj.metrics["agent_calls"] == 2 and traj.metrics["agent_chains"] == 1 and traj.metrics["turns"] == 2
        trained = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
        policy_segments = [s for s in traj.segments if s.kind == "policy"]
        assert trained == [t for s in policy_segments for t in traj.token_ids[s.start:s.end]]
        assert all(lp == -0.5 for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if m)
        env_segments = [s for s in traj.segments if s.kind == "env"]
        assert env_segments and "temp_c" in env_segments[0].text  # the tool result: in the sequence, masked
        assert all(traj.loss_mask[i] == 0 for s in env_segments for i in range(s.start, s.end))


def test_a_rewritten_history_makes_a_second_chain_and_a_raising_agent_fails(tiny):
    async def forgetful(client, task):
        first = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
        await client.chat.completions.create(model="p", messages=[  # drops the first reply: a new chain
            {"role": "user", "content": "hi"}, {"role": "user", "content": "again"}])
        return 0.5 if first.choices else 0.0

    async def broken(client, task):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
        raise KeyError("no such tool")

    register("test/Forgetful-v0", lambda: AgentEnv(forgetful, tasks=["t"]))
    register("test/Broken-v0", lambda: AgentEnv(broken, tasks=["t"]))
    engine = ScriptedEngine(tiny, lambda turn: "ok")
    forgot = _run(tiny, engine, "test/Forgetful-v0", n=1, group=1)
    assert len(forgot) == 2 and [t.metrics["agent_chain"] for t in forgot] == [0, 1]
    assert all(t.reward == 0.5 and t.metrics["agent_chains"] == 2 for t in forgot)
    [failed] = _run(tiny, engine, "test/Broken-v0", n=1, group=1)
    assert failed.status == "failed" and "agent raised KeyError" in failed.status_reason


def test_the_example_checks_rolls_out_and_trains(tmp_path, capsys):
    assert main(["check", str(EXAMPLE)]) == 0
    out = tmp_path / "agent.jsonl"
    assert main(["rollout", "--env", str(EXAMPLE), "--model", "tiny", "-n", "2", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["status"] == "completed" and r["metrics"]["agent_calls"] >= 1 for r in rows)
    run = tmp_path / "run"
    code = main(["train", str(ROOT / "examples" / "configs" / "quickstart.yaml"), f"run_dir={run}",
                 f"envs=[{{id: {EXAMPLE}}}]", "model=tiny", "trainer.total_steps=2", "trainer.checkpoint_every=2",
                 "trainer.eval_every=0", "rollout.groups_per_step=2", "rollout.group_size=2",
                 "rollout.max_new_tokens=16", "rollout.max_total_tokens=1024", "algorithm.entropy_coef=0.01"])
    assert code == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]


def test_an_agent_can_stream_and_list_models_and_is_refused_n_above_one(tiny):
    async def streaming(client, task):
        names = [m.id async for m in client.models.list()]
        stream = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}],
                                                      stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        try:
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}], n=2)
        except Exception as err:  # openai.BadRequestError
            refused = "n must be 1" in str(err)
        return float(names == ["tiny"] and text == "streamed" and refused)

    register("test/Streaming-v0", lambda: AgentEnv(streaming, tasks=["t"]))
    [traj] = _run(tiny, ScriptedEngine(tiny, ["streamed"]), "test/Streaming-v0", n=1, group=1)
    assert traj.status == "completed" and traj.reward == 1.0 and traj.metrics["agent_calls"] == 1  # n=2: refused


def _data_url(color: str, size: tuple[int, int] = (64, 48)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def _two_calls(client, first: list, second: list) -> float:
    """Asks, then continues the conversation with the reply it got and another user turn: one chain."""
    messages = [{"role": "user", "content": first}]
    reply = await client.chat.completions.create(model="p", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                 {"role": "user", "content": second}]
    await client.chat.completions.create(model="p", messages=messages, max_tokens=6)
    return 1.0


def test_a_vision_agent_sends_images_as_data_urls_and_a_text_model_or_a_url_is_refused_with_why(tiny):
    vl = load_model("tiny-vl")

    async def looks(client, task):
        return await _two_calls(client, [{"type": "image_url", "image_url": {"url": _data_url("red")}},
                                         {"type": "text", "text": "Which colour?"}],
                                [{"type": "text", "text": "And this one?"},
                                 {"type": "image_url", "image_url": {"url": _data_url("blue", (32, 32))}}])

    async def fetches(client, task):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/cat.png"}}]}])
        return 1.0

    register("test/Looks-v0", lambda: AgentEnv(looks, tasks=["t"]))
    register("test/Fetches-v0", lambda: AgentEnv(fetches, tasks=["t"]))
    end = vl.tokenizer.convert_tokens_to_ids("<|im_end|>")
    [traj] = _run(vl, EndsEachTurn(EmbeddedEngine(vl), end), "test/Looks-v0", n=1, group=1)
    assert traj.status == "completed", traj.status_reason
    assert traj.metrics["agent_chains"] == 1 and traj.metrics["turns"] == 2
    assert [im.size for im in traj.media] == [(64, 48), (32, 32)]
    assert traj.mm_inputs["image_grid_thw"].shape[0] == 2  # both images reached the processor, in turn order
    [refused] = _run(vl, ScriptedEngine(vl, ["x"]), "test/Fetches-v0", n=1, group=1)
    assert refused.status == "failed" and "only inline media are taken" in refused.status_reason
    [text_only] = _run(tiny, ScriptedEngine(tiny, ["x"]), "test/Looks-v0", n=1, group=1)
    assert text_only.status == "failed" and "BadRequestError" in text_only.status_reason
    assert "'tiny' takes text only" in text_only.status_reason and "test_agents.py" in text_only.status_reason


def test_a_moe_agent_keeps_each_chains_routes_and_a_seeded_run_repeats_itself():
    moe = load_model("tiny-moe")
    config = moe.model.config
    end = moe.tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def chats(client, task):
        return await _two_calls(client, "Say a number.", "Another one.")

    register("test/Chats-v0", lambda: AgentEnv(chats, tasks=["a", "b"]))
    runs = []
    for _ in range(2):
        engine = EndsEachTurn(EmbeddedEngine(moe), end)
        trajs = _run(moe, engine, "test/Chats-v0", n=1, group=2, routed_experts=True, sampling_seed=5,
                     sampling=SamplingParams(max_new_tokens=6, temperature=1.0))
        runs.append(trajs)
        for traj in trajs:
            assert traj.status == "completed" and traj.metrics["agent_chains"] == 1, traj.status_reason
            request, out = next((r, o) for r, o in reversed(engine.requests)
                                if r.input_ids == traj.token_ids[: len(r.input_ids)])
            assert request.return_routed_experts and request.sampling.seed is not None
            assert traj.routed_experts.shape == (len(traj.token_ids) - 1, config.num_hidden_layers,
                                                 config.num_experts_per_tok)
            assert np.array_equal(traj.routed_experts.reshape(-1), out.routed_experts)
    assert [t.token_ids for t in runs[0]] == [t.token_ids for t in runs[1]]
    assert runs[0][0].token_ids != runs[0][1].token_ids  # the two members of a group draw different samples


def test_the_runs_turn_and_token_limits_end_an_endless_agent_as_truncated(tiny):
    async def endless(client, task):
        messages = [{"role": "user", "content": "Count."}]
        while True:  # until the proxy refuses a call
            reply = await client.chat.completions.create(model="p", messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": "More."}]

    async def amnesiac(client, task):
        while True:  # a fresh conversation every call: a new chain each time
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "Count."}])

    register("test/Endless-v0", lambda: AgentEnv(endless, tasks=["t"]))
    register("test/Amnesiac-v0", lambda: AgentEnv(amnesiac, tasks=["t"]))
    engine = ScriptedEngine(tiny, lambda turn: "one two three")
    manager = RolloutManager(engine, tiny, sampling=SamplingParams(max_new_tokens=8),
                             limits=RolloutLimits(max_turns=3, max_total_tokens=4096, episode_timeout_s=60))
    [by_turns] = asyncio.run(manager.run("test/Endless-v0", 1))
    assert (by_turns.status, by_turns.status_reason, by_turns.metrics["turns"]) == ("truncated", "max_turns", 3)
    assert by_turns.metrics["agent_calls"] == 4  # the fourth was refused
    chains = asyncio.run(manager.run("test/Amnesiac-v0", 1))  # max_turns counts the calls of every chain
    assert len(chains) == 3 and all(t.metrics["turns"] == 1 and t.status == "truncated" for t in chains)
    prompt = len(asyncio.run(_first_prompt(tiny)))
    manager = RolloutManager(engine, tiny, sampling=SamplingParams(max_new_tokens=8),
                             limits=RolloutLimits(max_turns=8, max_total_tokens=prompt + 3, episode_timeout_s=60))
    [by_tokens] = asyncio.run(manager.run("test/Endless-v0", 1))
    assert (by_tokens.status, by_tokens.status_reason) == ("truncated", "token_budget")
    assert sum(by_tokens.loss_mask) == 3  # the reply was cut where the budget ends; the next call was refused
    assert by_tokens.metrics["agent_calls"] == 2 and by_tokens.metrics["turns"] == 1
    manager = RolloutManager(engine, tiny, limits=RolloutLimits(max_total_tokens=prompt - 1, episode_timeout_s=60))
    [too_small] = asyncio.run(manager.run("test/Endless-v0", 1))  # what a run stops on: every episode fails so
    assert too_small.status == "failed" and too_small.status_reason == (
        f"prompt over max_total_tokens: the agent's first prompt is {prompt} tokens (chat template and tools "
        f"included), rollout.max_total_tokens is {prompt - 1}")


async def _first_prompt(loaded) -> list[int]:
    from relax_gym.messages import text
    from relax_gym.rollout.tokens import ConversationTokens

    return ConversationTokens.start(loaded, [{"role": "user", "content": [text("Count.")]}], None).token_ids


def test_an_agents_huge_call_is_refused_before_it_is_rendered_and_the_loop_keeps_serving(tiny):
    """4 MB of text in a first call: the episode fails with why at once (it could never fit the budget), and the
    other episode on the same loop, an ordinary agent, completes meanwhile."""
    async def flood(client, task):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x " * 2_000_000}])

    async def ordinary(client, task):
        reply = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "Count."}])
        return 1.0 if reply.choices[0].message.content else 0.0

    register("test/Flood-v0", lambda: AgentEnv(flood, tasks=["t"]))
    register("test/Ordinary-v0", lambda: AgentEnv(ordinary, tasks=["t"]))
    engine = ScriptedEngine(tiny, lambda turn: "one two three")
    manager = RolloutManager(engine, tiny, sampling=SamplingParams(max_new_tokens=8),
                             limits=RolloutLimits(max_total_tokens=4096, episode_timeout_s=60))

    async def both():
        try:
            return await asyncio.gather(manager.run("test/Flood-v0", 1), manager.run("test/Ordinary-v0", 1))
        finally:
            await manager.close()

    [flooded], [served] = asyncio.run(both())
    assert flooded.status == "failed" and flooded.status_reason.startswith(
        "prompt over max_total_tokens: the agent's messages are 4000000 characters")
    assert served.status == "completed" and served.reward == 1.0
