"""Procedural envs: Arithmetic, Countdown, GuessNumber."""

from __future__ import annotations

import json
import math

import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given
from hypothesis import strategies as st

import relax_gym
from relax_gym.env.core import EpisodeOverError
from relax_gym.envs.procedural import chain_value, evaluate_expression, last_integer

MALFORMED = ["", "garbage %$#@!", "<answer>", "<answer></answer>", "<answer>" + "(" * 500 + "</answer>",
             "\\boxed{", "9" * 200_000, "-" * 100_000]  # fmt: skip
CONFIGS = [
    ("relax/Arithmetic-v0", {}),
    ("relax/Arithmetic-v0", {"digits": 3, "n_terms": 4, "ops": "+-*", "answer_format": "boxed"}),
    ("relax/Countdown-v0", {}),
    ("relax/Countdown-v0", {"n_numbers": 4, "max_number": 50, "max_target": 200, "format_score": 0.0}),
    ("relax/GuessNumber-v0", {}),
    ("relax/GuessNumber-v0", {"low": -50, "high": 1000, "max_turns": 12, "shaped": True}),
]
IDS = [f"{env_id.split('/')[1]}-{i}" for i, (env_id, _) in enumerate(CONFIGS)]


@pytest.mark.parametrize(("env_id", "kwargs"), CONFIGS, ids=IDS)
def test_check_env(env_id, kwargs):
    check_env(relax_gym.make(env_id, **kwargs))


@pytest.mark.parametrize(("env_id", "kwargs"), CONFIGS, ids=IDS)
def test_reset_is_deterministic_per_seed(env_id, kwargs):
    env = relax_gym.make(env_id, **kwargs)
    first = [env.reset(seed=s) for s in range(20)]
    assert first == [env.reset(seed=s) for s in range(20)]
    if env_id != "relax/GuessNumber-v0":  # its prompt is the same for every secret
        assert len({obs[0]["content"][0]["text"] for obs, _ in first}) > 10


@pytest.mark.parametrize(("env_id", "kwargs"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("action", MALFORMED, ids=lambda a: f"{a[:10]!r}..{len(a)}")
def test_malformed_actions_never_raise(env_id, kwargs, action):
    env = relax_gym.make(env_id, **kwargs)
    env.reset(seed=3)
    _, reward, _, _, info = env.step(action)
    assert reward <= 0.1
    json.dumps(info)


@pytest.mark.parametrize("env_id", ["relax/Arithmetic-v0", "relax/Countdown-v0", "relax/GuessNumber-v0"])
def test_step_outside_an_episode_raises_clearly(env_id):
    with pytest.raises(EpisodeOverError):
        relax_gym.make(env_id).step("1")


# --- helpers ------------------------------------------------------------------------


def test_last_integer():
    assert last_integer("3 + 4 = 7") == 7
    assert last_integer("x = -12.") == -12
    assert last_integer("8-3") == 3  # a minus glued to a number is subtraction, not a sign
    assert last_integer("no digits") is None
    assert last_integer("1" * 31) is None


@pytest.mark.parametrize(
    ("source", "value", "numbers"),
    [("(3 + 5) * 2", 16, [3, 5, 2]), ("7 / 2 * 2", 7, [7, 2, 2]), ("-(4 - 9)", 5, [4, 9]), ("10", 10, [10])],
)
def test_evaluate_expression(source, value, numbers):
    assert evaluate_expression(source) == (value, numbers)


@pytest.mark.parametrize(
    "source",
    ["__import__('os').system('true')", "2 ** 10", "1.5 + 1", "x + 1", "3 // 2", "(1).real", "1 / 0", "True + 1",
     "", "1 +", "(" * 250 + "1" + ")" * 250, "1+" * 20_000 + "1"],
)  # fmt: skip
def test_evaluate_expression_rejects_everything_else(source):
    with pytest.raises(ValueError):
        evaluate_expression(source)


# --- Arithmetic -----------------------------------------------------------------------


@pytest.mark.parametrize("answer_format", ["plain", "boxed"])
def test_arithmetic_scores_the_integer(answer_format):
    env = relax_gym.make("relax/Arithmetic-v0", digits=2, n_terms=3, ops="+-*", answer_format=answer_format)
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        expression = obs[0]["content"][0]["text"].removeprefix("What is ").split("?")[0]
        answer = int(evaluate_expression(expression)[0])
        assert answer == env.unwrapped.task["answer"]
        right = f"{expression} = \\boxed{{{answer}}}" if answer_format == "boxed" else f"{expression} = {answer}"
        _, reward, terminated, truncated, info = env.step(right)
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert info["answer_format"] == answer_format and info["reward"]["extracted"] == str(answer)
        env.reset(seed=seed)
        assert env.step(right.replace(str(answer), str(answer + 1)))[1] == 0.0


def test_arithmetic_boxed_format_requires_the_box():
    env = relax_gym.make("relax/Arithmetic-v0", answer_format="boxed")
    env.reset(seed=0)
    _, reward, _, _, info = env.step(str(env.unwrapped.task["answer"]))
    assert reward == 0.0 and "boxed" in info["reward"]["detail"]


def test_arithmetic_respects_difficulty():
    env = relax_gym.make("relax/Arithmetic-v0", digits=3, n_terms=4, ops="*")
    obs, _ = env.reset(seed=1)
    terms = obs[0]["content"][0]["text"].removeprefix("What is ").split("?")[0].split(" * ")
    assert len(terms) == 4 and all(100 <= int(t) <= 999 for t in terms)


@pytest.mark.parametrize("kwargs", [{"digits": 0}, {"n_terms": 1}, {"ops": "/"}, {"answer_format": "json"}])
def test_arithmetic_rejects_bad_kwargs(kwargs):
    with pytest.raises(ValueError):
        relax_gym.make("relax/Arithmetic-v0", **kwargs)


# --- Countdown --------------------------------------------------------------------------


def test_countdown_targets_are_always_solvable_with_the_given_numbers():
    env = relax_gym.make("relax/Countdown-v0", n_numbers=4, max_number=20, max_target=60)
    for seed in range(200):
        env.reset(seed=seed)
        task = env.unwrapped.task
        value, used = evaluate_expression(task["solution"])
        assert value == task["target"] and sorted(used) == sorted(task["numbers"])
        assert 1 <= task["target"] <= 60


def test_countdown_reward_follows_tinyzero():
    env = relax_gym.make("relax/Countdown-v0")
    task = {"numbers": [3, 5, 2], "target": 16}

    def score(text: str) -> float:
        env.reset(seed=0)
        env.unwrapped.task |= task
        return env.step(text)[1]

    assert score("<think>...</think><answer>(3 + 5) * 2</answer>") == 1.0
    assert score("<answer>(5 + 3) * 2</answer>") == 1.0
    assert score("<answer>8 * 2</answer>") == 0.1  # 8 is not given
    assert score("<answer>(3 + 5) * 2 * 2 / 2</answer>") == 0.1  # 2 used three times
    assert score("<answer>3 + 5 + 2</answer>") == 0.1  # valid, but 10
    assert score("<answer>import os</answer>") == 0.1
    assert score("(3 + 5) * 2") == 0.0  # no answer tag
    assert score(f"<answer>{'+'.join(['0'] * 200)}</answer>") == 0.1  # too long to parse
    assert score("<answer>wrong</answer> then <answer>(3+5)*2</answer>") == 1.0  # the last tag counts


def test_countdown_each_number_at_most_once_and_format_score_kwarg():
    env = relax_gym.make("relax/Countdown-v0", format_score=0.0)
    env.reset(seed=0)
    env.unwrapped.task |= {"numbers": [4, 4, 7], "target": 11}
    _, reward, _, _, info = env.step("<answer>4 + 7</answer>")  # one 4 left unused: allowed
    assert reward == 1.0 and info["reward"]["extracted"] == "4 + 7"
    env.reset(seed=0)
    assert env.step("<answer>1 + 1</answer>")[1] == 0.0


def test_countdown_rejects_bad_kwargs():
    with pytest.raises(ValueError, match="max_target"):
        relax_gym.make("relax/Countdown-v0", max_number=60, max_target=100)
    with pytest.raises(ValueError, match="format_score"):
        relax_gym.make("relax/Countdown-v0", format_score=2.0)


# --- GuessNumber -----------------------------------------------------------------------


def binary_search(env, low: int, high: int) -> tuple[int, float, dict]:
    for _ in range(env.unwrapped.max_turns):
        guess = (low + high) // 2
        obs, reward, terminated, truncated, info = env.step(f"My guess is {guess}")
        if terminated or truncated:
            return info["turn"], reward, info
        if info["feedback"] == "higher":
            low = guess + 1
        else:
            assert info["feedback"] == "lower" and "Lower" in obs[0]["content"][0]["text"]
            high = guess - 1
    raise AssertionError("episode did not end")


@pytest.mark.parametrize(("low", "high"), [(1, 16), (1, 1), (-7, 7), (0, 1000)])
def test_binary_search_always_wins_within_log2_turns(low, high):
    bound = math.floor(math.log2(high - low + 1)) + 1
    env = relax_gym.make("relax/GuessNumber-v0", low=low, high=high, max_turns=bound)
    secrets = set()
    for seed in range(60):
        env.reset(seed=seed)
        secrets.add(env.unwrapped.episode["secret"])
        turns, reward, info = binary_search(env, low, high)
        assert reward == 1.0 and info["feedback"] == "correct" and turns <= bound
    assert secrets <= set(range(low, high + 1)) and len(secrets) > min(10, high - low)


def test_guess_number_feedback_truncation_and_shaping():
    env = relax_gym.make("relax/GuessNumber-v0", max_turns=3, shaped=True)
    env.reset(seed=0)
    secret = env.unwrapped.episode["secret"]
    wrong = 1 if secret != 1 else 2
    obs, reward, terminated, truncated, info = env.step("I do not know")
    assert info["feedback"] == "invalid" and "integer" in obs[0]["content"][0]["text"] and not truncated
    obs, *_ = env.step(str(wrong))
    assert ("Higher" if secret > wrong else "Lower") in obs[0]["content"][0]["text"]
    obs, reward, terminated, truncated, info = env.step(str(secret))
    assert (reward, terminated, truncated) == (pytest.approx(1 / 3), True, False)
    env.reset(seed=0)
    for _ in range(2):
        env.step(str(wrong))
    _, reward, terminated, truncated, info = env.step(str(wrong))
    assert (reward, terminated, truncated) == (0.0, False, True)
    assert info["truncated_by"] == "max_turns" and info["reward"]["score"] == 0.0


def test_guess_number_state_round_trip_resumes_identically():
    env = relax_gym.make("relax/GuessNumber-v0", low=1, high=100, max_turns=8)
    env.reset(seed=42)
    env.step("50")
    env.step("not a number")
    state = env.get_state()
    json.dumps(state["episode"])
    plan = ["25", "75", "60", "90"]
    expected = [env.step(a) for a in plan]
    other = relax_gym.make("relax/GuessNumber-v0", low=1, high=100, max_turns=8)
    other.set_state(state)
    assert [other.step(a) for a in plan] == expected
    env.set_state(state)  # the snapshot was not changed by the steps taken after it
    assert [env.step(a) for a in plan] == expected
    assert env.supports_state


@given(st.lists(st.integers(0, 999), min_size=2, max_size=6), st.data())
def test_chain_value_equals_the_parsed_expressions_value(terms, data):
    ops = data.draw(st.lists(st.sampled_from("+-*"), min_size=len(terms) - 1, max_size=len(terms) - 1))
    expression = " ".join([str(terms[0]), *(f"{op} {term}" for op, term in zip(ops, terms[1:], strict=True))])
    assert chain_value(terms, ops) == evaluate_expression(expression)[0]
