import pytest

from relax_gym import EpisodeOverError, SingleTurnEnv
from relax_gym.env.conformance import run_checks
from relax_gym.rewards import RewardResult


class Capital(SingleTurnEnv):
    """Name a capital."""

    system_prompt = "Answer with one word."
    CAPITALS = (("France", "Paris"), ("Japan", "Tokyo"), ("Peru", "Lima"))

    def new_task(self, rng, options):
        country, city = self.CAPITALS[int(options.get("index", rng.integers(len(self.CAPITALS))))]
        return {"prompt": f"What is the capital of {country}?", "answer": city}

    def grade(self, task, answer):
        return float(answer.strip().lower() == task["answer"].lower())

    def task_info(self, task):
        return {"answer_len": len(task["answer"])}


def test_one_prompt_one_graded_answer():
    env = Capital()
    obs, info = env.reset(seed=0, options={"index": 1})
    assert [m["role"] for m in obs] == ["system", "user"]
    assert obs[1]["content"][0]["text"] == "What is the capital of Japan?"
    assert info == {"answer_len": 5}
    obs, reward, terminated, truncated, info = env.step(" tokyo ")
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["reward"] == RewardResult(1.0).to_info() and info["answer_len"] == 5
    with pytest.raises(EpisodeOverError):
        env.step("again")


def test_state_round_trip_and_conformance():
    env = Capital()
    env.reset(seed=3)
    other = Capital()
    other.set_state(env.get_state())
    assert other.step("Lima")[1] == env.step("Lima")[1]
    report = run_checks("capital", Capital)
    assert report.passed, [r for r in report.results if not r.passed]
