"""Rewards for relax_gym environments: answer extraction, math/choice/text/format scores.

Every reward returns a :class:`RewardResult` and never raises on a completion: a timeout
or a crash is recorded in ``status``, never passed off as a wrong answer.
"""

from typing import TYPE_CHECKING, Any

from relax_gym.rewards.choice import multiple_choice_reward
from relax_gym.rewards.extract import extract_boxed, extract_dapo_answer, extract_tag
from relax_gym.rewards.format_check import format_reward, think_answer_format
from relax_gym.rewards.math_answer import AnswerFormat, math_reward, shutdown_math_workers
from relax_gym.rewards.result import RewardResult, RewardStatus
from relax_gym.rewards.text_match import exact_match_reward, f1_reward, normalize_answer

if TYPE_CHECKING:
    from relax_gym.rewards.judge import JudgeReward


def __getattr__(name: str) -> Any:
    """`JudgeReward` on first use: importing the rewards costs no HTTP client."""
    if name == "JudgeReward":
        from relax_gym.rewards.judge import JudgeReward

        return JudgeReward
    raise AttributeError(f"module 'relax_gym.rewards' has no attribute {name!r}")


__all__ = [
    "AnswerFormat",
    "JudgeReward",
    "RewardResult",
    "RewardStatus",
    "exact_match_reward",
    "extract_boxed",
    "extract_dapo_answer",
    "extract_tag",
    "f1_reward",
    "format_reward",
    "math_reward",
    "multiple_choice_reward",
    "normalize_answer",
    "shutdown_math_workers",
    "think_answer_format",
]
