"""The rollout manager on every bundled env with the real tiny models and the real embedded engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from support.engine_doubles import RecordingEngine

import relax_gym
from relax_gym.engines.base import SamplingParams
from relax_gym.engines.embedded import EmbeddedEngine
from relax_gym.envs.procedural import ArithmeticEnv
from relax_gym.messages import user
from relax_gym.models import load_model
from relax_gym.rollout import RolloutLimits, RolloutManager
from relax_gym.trainer.backends.torch_backend import TorchBackend
from relax_gym.trainer.batch import Sample

ENV_MODELS = [
    ("relax/Math-v0", "tiny"),
    ("relax/MathTool-v0", "tiny"),
    ("relax/Arithmetic-v0", "tiny"),
    ("relax/Countdown-v0", "tiny"),
    ("relax/GuessNumber-v0", "tiny"),
    ("relax/ReasoningGym-v0", "tiny"),
    ("relax/DeepEyes-v0", "tiny-vl"),
    ("relax/AudioQA-v0", "tiny-audio"),
]
TEMPERATURE = 0.8
WARM_START = Path(__file__).resolve().parents[2] / "examples" / "checkpoints" / "tiny-arithmetic"


@pytest.fixture(scope="module")
def models():
    return {name: load_model(name) for name in ("tiny", "tiny-vl", "tiny-audio")}


def rollout(loaded, env_id, n=2, group=2, **limits):
    async def run():
        engine = RecordingEngine(EmbeddedEngine(loaded, seed=0))
        manager = RolloutManager(engine, loaded, sampling=SamplingParams(temperature=TEMPERATURE, max_new_tokens=24),
                                 limits=RolloutLimits(max_turns=3, max_total_tokens=4096, **limits))
        try:
            return await manager.run(env_id, n, group, seed=0), engine.outputs
        finally:
            await manager.close()
            await engine.close()

    return asyncio.run(run())


@pytest.mark.parametrize(("env_id", "model"), ENV_MODELS)
def test_trajectories_meet_the_contract(models, env_id, model):
    if env_id == "relax/ReasoningGym-v0":
        pytest.importorskip("reasoning_gym")
    loaded = models[model]
    trajs, outputs = rollout(loaded, env_id)
    assert len(trajs) == 4
    assert Counter(t.group_id for t in trajs) == {f"{env_id}#0": 2, f"{env_id}#1": 2}
    policy_tokens = []
    for t in trajs:
        t.check()  # equal lengths; masked tokens carry logprob 0 and version -1
        assert t.status in ("completed", "truncated"), t.status_reason
        assert t.metrics["rerender_match"], t.metrics  # decoding reproduces the conversation
        for seg in t.segments:
            mask = t.loss_mask[seg.start:seg.end]
            assert mask == [int(seg.kind == "policy")] * (seg.end - seg.start)
            if seg.kind == "policy":
                policy_tokens.append(t.token_ids[seg.start:seg.end])
        assert t.prompt_len == t.segments[0].end and t.segments[0].kind == "prompt"
    # the trained tokens are exactly what the engine generated, turn by turn
    assert Counter(map(tuple, policy_tokens)) == Counter(map(tuple, outputs))


@pytest.mark.parametrize("model", ["tiny", "tiny-vl", "tiny-audio"])
def test_engine_logprobs_equal_a_teacher_forced_forward(models, model):
    env_id = {"tiny": "relax/GuessNumber-v0", "tiny-vl": "relax/DeepEyes-v0", "tiny-audio": "relax/AudioQA-v0"}[model]
    loaded = models[model]
    trajs, _ = rollout(loaded, env_id, n=1, group=2)
    backend = TorchBackend(load_model(model))  # the same seeded weights, separately built
    samples = [Sample(t.token_ids, t.loss_mask, t.rollout_logprobs, mm_inputs=t.mm_inputs) for t in trajs]
    worst = 0.0
    for t, out in zip(trajs, backend.logprobs(samples, temperature=TEMPERATURE), strict=True):
        for i, m in enumerate(t.loss_mask):
            if m:
                worst = max(worst, abs(out.logprobs[i].item() - t.rollout_logprobs[i]))
    print(f"{model}: max |engine - teacher-forced| logprob = {worst:.2e}")
    assert worst <= 1e-4


class Exploding(ArithmeticEnv):
    """Fails in step: the manager must turn that into a failed record, not a crashed run."""

    def step(self, action):
        raise RuntimeError("the judge fell over")


class Sleepy(ArithmeticEnv):
    blocking = True  # it sleeps: it must run off the event loop, unlike the arithmetic it extends

    def step(self, action):
        time.sleep(5)
        return super().step(action)


class Retry(ArithmeticEnv):
    """Never satisfied: only the manager's turn limit ends the episode."""

    def step(self, action):
        return [user("Wrong, try again. " + self.task["prompt"])], 0.0, False, False, {}


class Flood(ArithmeticEnv):
    """Answers every action with 4 MB of text: far more than any budget, which must not be tokenized."""

    def step(self, action):
        return [user("x " * 2_000_000)], 0.0, False, False, {}


async def _episodes(loaded, env_id, n=1, limits=None, max_new_tokens=24, temperature=1.0):
    engine = EmbeddedEngine(loaded, seed=0)
    manager = RolloutManager(engine, loaded, limits=limits,
                             sampling=SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens))
    try:
        return await manager.run(env_id, n, 1)
    finally:
        await manager.close()
        await engine.close()


@pytest.fixture(scope="module")
def warm():
    """The warm-start model ends its turns (greedy), so episodes reach env.step and the limits."""
    return load_model(str(WARM_START))


def test_env_crash_becomes_a_failed_trajectory_with_its_reason(warm):
    relax_gym.register("test/Exploding-v0", Exploding)
    trajs = asyncio.run(_episodes(warm, "test/Exploding-v0", n=2, temperature=0.0, max_new_tokens=8))
    assert {t.status for t in trajs} == {"failed"}
    assert all("RuntimeError: the judge fell over" in t.status_reason for t in trajs)
    assert all(t.num_generated > 0 for t in trajs)  # what was generated is kept


def test_episode_timeout_aborts_without_hanging(warm):
    relax_gym.register("test/Sleepy-v0", Sleepy)
    (traj,) = asyncio.run(_episodes(warm, "test/Sleepy-v0", temperature=0.0, max_new_tokens=8,
                                    limits=RolloutLimits(episode_timeout_s=1.0)))
    assert traj.status == "aborted" and "timed out" in traj.status_reason


def test_the_turn_limit_truncates_a_multi_turn_episode(warm):
    relax_gym.register("test/Retry-v0", Retry)
    (traj,) = asyncio.run(_episodes(warm, "test/Retry-v0", temperature=0.0, max_new_tokens=8,
                                    limits=RolloutLimits(max_turns=2)))
    assert (traj.status, traj.status_reason) == ("truncated", "max_turns")
    assert traj.metrics["turns"] == 2 and traj.metrics["rerender_match"]
    assert [s.kind for s in traj.segments] == ["prompt", "policy", "glue", "env", "policy"]


def test_an_observation_that_cannot_fit_the_budget_ends_the_episode_untokenized(warm):
    relax_gym.register("test/Flood-v0", Flood)
    (traj,) = asyncio.run(_episodes(warm, "test/Flood-v0", temperature=0.0, max_new_tokens=8,
                                    limits=RolloutLimits(max_turns=4, max_total_tokens=4096)))
    assert (traj.status, traj.status_reason) == ("truncated", "token_budget")
    assert traj.metrics["turns"] == 1 and len(traj.token_ids) < 4096  # the flood never joined the sequence


def test_the_token_budget_caps_generation(models):
    (first,) = asyncio.run(_episodes(models["tiny"], "relax/GuessNumber-v0"))
    (traj,) = asyncio.run(_episodes(models["tiny"], "relax/GuessNumber-v0",
                                    limits=RolloutLimits(max_total_tokens=first.prompt_len + 5)))
    assert (traj.status, traj.status_reason) == ("truncated", "token_budget")
    assert len(traj.token_ids) == first.prompt_len + 5


def test_a_dead_engine_aborts_episodes_with_a_clear_reason(models):
    from relax_gym.engines.sglang import SGLangEngine

    async def run():
        engine = SGLangEngine("http://127.0.0.1:9", timeout_s=2, retries=1)
        manager = RolloutManager(engine, models["tiny"], sampling=SamplingParams(max_new_tokens=4))
        try:
            return await manager.run("relax/Arithmetic-v0", 2, 1)
        finally:
            await manager.close()
            await engine.close()

    trajs = asyncio.run(run())
    assert {t.status for t in trajs} == {"aborted"}
    assert all("127.0.0.1:9" in t.status_reason for t in trajs)


class Judged(ArithmeticEnv):
    """Each step waits for 15 other episodes' steps (a barrier), as if they shared a slow remote judge."""

    blocking = True
    barrier = threading.Barrier(16, timeout=60)

    def step(self, action):
        self.barrier.wait()  # breaks (and the step raises) unless 16 steps run at the same time
        return super().step(action)


def test_blocking_env_steps_run_concurrently_not_a_few_at_a_time(warm):
    relax_gym.register("test/Judged-v0", Judged)
    trajs = asyncio.run(_episodes(warm, "test/Judged-v0", n=16, temperature=0.0, max_new_tokens=8))
    # with asyncio's stock pool (min(32, cpus + 4) threads) the barrier would break: failed episodes
    assert {t.status for t in trajs} == {"completed"}, {t.status_reason for t in trajs}
