"""The scripted engine through the real rollout manager: exact tokens, per-conversation turns, failures."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import runpy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import relax_gym
from relax_gym.engines import (
    Engine,
    EngineError,
    GenerateRequest,
    SamplingParams,
    ScriptedEngine,
    ScriptedTurn,
    ScriptError,
)
from relax_gym.models import LoadedModel, load_model
from relax_gym.rollout import RolloutLimits, RolloutManager
from relax_gym.trajectory import Trajectory

pytestmark = pytest.mark.filterwarnings("ignore::relax_gym.sandbox.SandboxFallbackWarning")

ROOT = Path(__file__).resolve().parents[2]
SIX_TIMES_SEVEN = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny")


def rollout(engine: Engine, loaded: LoadedModel, env_id: str, n_tasks: int = 1, group_size: int = 1, *,
            sampling: SamplingParams | None = None, env_kwargs: dict[str, Any] | None = None) -> list[Trajectory]:
    async def run() -> list[Trajectory]:
        manager = RolloutManager(engine, loaded, sampling=sampling, limits=RolloutLimits(max_turns=8))
        try:
            return await manager.run(env_id, n_tasks, group_size, seed=0, env_kwargs=env_kwargs)
        finally:
            await manager.close()

    return asyncio.run(run())


def policy_tokens(traj: Trajectory) -> list[list[int]]:
    return [traj.token_ids[s.start:s.end] for s in traj.segments if s.kind == "policy"]


def scripted_ids(loaded: LoadedModel, replies: Sequence[str]) -> list[list[int]]:
    eos = loaded.tokenizer.eos_token_id
    return [loaded.tokenizer(r, add_special_tokens=False)["input_ids"] + [eos] for r in replies]


def secret(seed: int) -> int:
    env = relax_gym.make("relax/GuessNumber-v0")
    env.reset(seed=seed)
    return int(env.episode["secret"])


def test_a_list_script_plays_a_tool_episode_with_exact_tokens(loaded: LoadedModel) -> None:
    env = relax_gym.make("relax/MathTool-v0")
    _, info = env.reset(seed=0)
    gold = env.tasks[info["task_index"]].answer
    replies = [SIX_TIMES_SEVEN, f"So the answer is \\boxed{{{gold}}}."]
    engine = ScriptedEngine(loaded, replies)
    assert isinstance(engine, Engine)
    asyncio.run(engine.update_weights(None, 3))

    [traj] = rollout(engine, loaded, "relax/MathTool-v0")

    assert (traj.status, traj.reward, traj.metrics["tool_calls"]) == ("completed", 1.0, 1), traj.status_reason
    assert traj.metrics["rerender_match"]
    assert policy_tokens(traj) == scripted_ids(loaded, replies)  # the script's tokens, each closed by <|im_end|>
    tool_turn = next(s for s in traj.segments if s.kind == "env")
    assert "stdout:\n42" in tool_turn.text  # the tool really ran the scripted call
    for s in traj.segments:  # trained exactly where the script spoke
        assert traj.loss_mask[s.start:s.end] == [int(s.kind == "policy")] * (s.end - s.start)
    trained = [i for i, m in enumerate(traj.loss_mask) if m]
    assert {traj.rollout_logprobs[i] for i in trained} == {0.0}
    assert {traj.versions[i] for i in trained} == {3}


def test_a_function_script_answers_the_last_observation(loaded: LoadedModel) -> None:
    """Bisection on GuessNumber, reading the feedback from the decoded prompt: 16 concurrent episodes."""
    mismatched: list[tuple[int, int]] = []

    def bisect(turn: ScriptedTurn) -> str:
        low, high = 1, 16
        feedback = re.findall(r"(Higher|Lower) than (\d+)\.", turn.text)
        for word, number in feedback:
            low, high = (int(number) + 1, high) if word == "Higher" else (low, int(number) - 1)
        if turn.turn != len(feedback):  # one feedback per earlier turn of this very episode
            mismatched.append((turn.turn, len(feedback)))
        return f"I guess {(low + high) // 2}"

    trajs = rollout(ScriptedEngine(loaded, bisect), loaded, "relax/GuessNumber-v0", n_tasks=16)

    assert not mismatched
    for traj in trajs:
        assert (traj.status, traj.reward) == ("completed", 1.0), traj.status_reason
        assert traj.metrics["turns"] <= 5  # log2(16) + 1


def test_concurrent_episodes_count_their_own_turns(loaded: LoadedModel) -> None:
    """Guessing 1, 2, 3, ... finds secret s on turn s, whatever the other 31 episodes are doing; the two
    members of a group hold identical conversations, which must not confuse each other either."""
    replies = [str(n) for n in range(1, 7)]
    trajs = rollout(ScriptedEngine(loaded, replies), loaded, "relax/GuessNumber-v0", n_tasks=16, group_size=2)

    assert len(trajs) == 32
    for traj in trajs:
        s = secret(traj.seed)
        if s <= 6:
            assert (traj.status, traj.reward, traj.metrics["turns"]) == ("completed", 1.0, s), traj.status_reason
        else:
            assert (traj.status, traj.status_reason, traj.metrics["turns"]) == ("truncated", "max_turns", 6)
        assert policy_tokens(traj) == scripted_ids(loaded, replies[: traj.metrics["turns"]])


def test_running_out_of_replies_aborts_the_episode_naming_the_turn(loaded: LoadedModel) -> None:
    [traj] = rollout(ScriptedEngine(loaded, ["0"]), loaded, "relax/GuessNumber-v0")  # the secret is never 0
    assert traj.status == "aborted"
    assert "no reply for turn 1: the script has 1 reply" in traj.status_reason
    assert policy_tokens(traj) == scripted_ids(loaded, ["0"])


def test_a_failing_reply_function_aborts_only_its_episode(loaded: LoadedModel) -> None:
    def flaky(turn: ScriptedTurn) -> str:
        if "Lower than" in turn.text:
            raise KeyError("no plan for lower")
        return "8"

    trajs = rollout(ScriptedEngine(loaded, flaky), loaded, "relax/GuessNumber-v0", n_tasks=8)
    for traj in trajs:
        s = secret(traj.seed)
        if s < 8:
            assert traj.status == "aborted"
            assert "reply function raised KeyError at turn 1" in traj.status_reason
        elif s == 8:
            assert traj.status == "completed"
        else:  # guessing 8 forever: never "lower"
            assert (traj.status, traj.status_reason) == ("truncated", "max_turns")


def test_max_new_tokens_cuts_a_long_reply(loaded: LoadedModel) -> None:
    reply = "Let me think about this for a long while before I guess: 8"
    [traj] = rollout(ScriptedEngine(loaded, [reply]), loaded, "relax/GuessNumber-v0",
                     sampling=SamplingParams(max_new_tokens=5))
    assert (traj.status, traj.status_reason) == ("truncated", "max_new_tokens")
    assert policy_tokens(traj) == [scripted_ids(loaded, [reply])[0][:5]]


def generate(engine: ScriptedEngine, input_ids: list[int], **sampling: Any) -> Any:
    return asyncio.run(engine.generate(GenerateRequest(input_ids, SamplingParams(**sampling))))


def test_outputs_end_as_a_real_engines_would(loaded: LoadedModel) -> None:
    eos = loaded.tokenizer.eos_token_id
    hello = loaded.tokenizer("hello there", add_special_tokens=False)["input_ids"]
    prompt = [1, 2, 3]

    def first(replies: list[str], **kwargs: Any) -> Any:
        return generate(ScriptedEngine(loaded, replies, **kwargs), prompt, max_new_tokens=len(hello) + 1)

    out = first(["hello there"], logprob=-0.5)
    assert (out.output_ids, out.finish_reason, out.prompt_tokens) == ([*hello, eos], "stop", 3)
    assert out.logprobs == [-0.5] * (len(hello) + 1)
    assert first(["hello there<|im_end|>"]).output_ids == [*hello, eos]  # not closed twice
    early = first(["hello<|im_end|> there"])  # a stop token ends the reply early
    assert early.output_ids == [*loaded.tokenizer("hello", add_special_tokens=False)["input_ids"], eos]
    no_stop = first(["hello there"], stop=False)
    assert (no_stop.output_ids, no_stop.finish_reason) == (hello, "stop")
    cut = generate(ScriptedEngine(loaded, ["hello there"]), prompt, max_new_tokens=len(hello))
    assert (cut.output_ids, cut.finish_reason) == (hello, "length")
    by_string = generate(ScriptedEngine(loaded, ["hello there"]), prompt, stop=("hel",))
    assert by_string.finish_reason == "stop" and len(by_string.output_ids) < len(hello)
    assert generate(ScriptedEngine(loaded, ["x"]), prompt, max_new_tokens=0).output_ids == []


def test_the_protocol_around_generation(loaded: LoadedModel) -> None:
    async def reply(turn: ScriptedTurn) -> str:  # an async function is awaited
        return f"turn {turn.turn}"

    async def scenario() -> None:
        engine = ScriptedEngine(loaded, reply)
        assert await engine.connect() == {"model_path": "tiny", "scripted": True}
        assert await engine.health()
        first = await engine.generate(GenerateRequest([1, 2, 3]))
        await engine.pause()
        waiting = asyncio.ensure_future(engine.generate(GenerateRequest([1, 2, 3, *first.output_ids, 4])))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # held by the pause
        await engine.update_weights({"ignored": 0}, 7)
        await engine.resume()
        second = await waiting
        assert loaded.tokenizer.decode(second.output_ids, skip_special_tokens=True) == "turn 1"
        assert (first.weight_version, second.weight_version) == (0, 7)
        await engine.close()
        assert not await engine.health()
        with pytest.raises(EngineError, match="closed"):
            await engine.generate(GenerateRequest([1]))

    asyncio.run(scenario())
    with pytest.raises(TypeError, match="list of strings"):
        ScriptedEngine(loaded, "one reply")  # type: ignore[arg-type]
    with pytest.raises(ScriptError, match="returned int"):
        generate(ScriptedEngine(loaded, lambda turn: 1), [1])  # type: ignore[arg-type, return-value]


def test_the_docs_snippet_runs(loaded: LoadedModel) -> None:
    """docs/envs.md's "Testing an env without a model" code, run as written, so it cannot rot."""
    page = (ROOT / "docs" / "envs.md").read_text()
    section = page.split("## Testing an env without a model\n", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    runpy.run_path(str(ROOT / "examples" / "custom_env.py"))  # registers example/Shopping-v0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "docs/envs.md", "exec"), {"__name__": "docs"})
    assert out.getvalue().strip() == "completed 1.0"
