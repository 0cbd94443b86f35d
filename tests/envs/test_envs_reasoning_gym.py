"""relax/ReasoningGym-v0: any reasoning-gym dataset, graded by its own scorer (optional extra)."""

from __future__ import annotations

import json
import sys

import pytest
from gymnasium.utils.env_checker import check_env

import relax_gym

ENV_ID = "relax/ReasoningGym-v0"
MALFORMED = ["", "garbage %$#@!", "<answer>", "<answer></answer>", "9" * 200_000]


def test_missing_package_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # makes `import reasoning_gym` fail
    with pytest.raises(ImportError, match=r"pip install 'relax-gym\[reasoning-gym\]'"):
        relax_gym.make(ENV_ID)


def test_listing_does_not_need_the_package():
    assert ENV_ID in relax_gym.list_envs()
    assert relax_gym.describe(ENV_ID)["description"].startswith("A reasoning-gym dataset")


@pytest.fixture
def rg():
    return pytest.importorskip("reasoning_gym")


@pytest.mark.parametrize(
    "kwargs", [{}, {"dataset": "basic_arithmetic", "size": 50, "min_terms": 2, "max_terms": 3}], ids=["default", "cfg"]
)
def test_check_env(rg, kwargs):
    check_env(relax_gym.make(ENV_ID, **kwargs))


def test_reset_is_deterministic_per_seed_and_dataset_seed(rg):
    env = relax_gym.make(ENV_ID, size=50)
    first = [env.reset(seed=s) for s in range(10)]
    assert first == [env.reset(seed=s) for s in range(10)]
    assert len({info["index"] for _, info in first}) > 5
    other = relax_gym.make(ENV_ID, size=50, dataset_seed=1)
    assert [other.reset(seed=s) for s in range(10)] != first


def test_prompt_carries_the_answer_tag_instruction(rg):
    obs, info = relax_gym.make(ENV_ID).reset(seed=0)
    assert [m["role"] for m in obs] == ["system", "user"] and "<answer>" in obs[0]["content"][0]["text"]
    assert info["dataset"] == info["source_dataset"] == "leg_counting"
    obs, _ = relax_gym.make(ENV_ID, system_prompt="").reset(seed=0)
    assert [m["role"] for m in obs] == ["user"]


@pytest.mark.parametrize("dataset", ["leg_counting", "basic_arithmetic", "word_sorting"])
def test_correct_answer_scores_one_wrong_scores_zero(rg, dataset):
    env = relax_gym.make(ENV_ID, dataset=dataset, size=20)
    env.reset(seed=1)
    answer = env.unwrapped.task["entry"]["answer"]
    obs, reward, terminated, truncated, info = env.step(f"Let me think.\n<answer>{answer}</answer>")
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["reward"] == {"score": 1.0, "status": "ok", "detail": None, "extracted": answer}
    env.reset(seed=1)
    assert env.step("<answer>certainly not this</answer>")[1] == 0.0


def test_untagged_reply_is_graded_whole(rg):
    env = relax_gym.make(ENV_ID)
    env.reset(seed=2)
    _, reward, _, _, info = env.step(f"  {env.unwrapped.task['entry']['answer']}\n")
    assert reward == 1.0 and "no <answer> tag" in info["reward"]["detail"]


@pytest.mark.parametrize("action", MALFORMED, ids=lambda a: f"{a[:10]!r}..{len(a)}")
def test_malformed_answers_never_raise(rg, action):
    env = relax_gym.make(ENV_ID)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(action)
    assert reward == 0.0 and terminated
    json.dumps(info)


def test_a_crashing_grader_is_an_error_not_a_zero(rg, monkeypatch):
    env = relax_gym.make(ENV_ID)
    env.reset(seed=0)
    monkeypatch.setattr(env.unwrapped.dataset, "score_answer", lambda answer, entry: 1 / 0)
    _, reward, _, _, info = env.step("<answer>1</answer>")
    assert reward == 0.0 and info["reward"]["status"] == "error" and "ZeroDivisionError" in info["reward"]["detail"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dataset": "leg_countin"}, "Did you mean 'leg_counting'"),
        ({"bogus": 1}, "config fields: min_animals"),
        ({"min_animals": 5, "max_animals": 2}, "max_animals must be >= min_animals"),
    ],
)
def test_bad_dataset_or_config_is_explained(rg, kwargs, match):
    with pytest.raises(ValueError, match=match):
        relax_gym.make(ENV_ID, **kwargs)
