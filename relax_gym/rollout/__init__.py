"""Rollouts: concurrent multi-turn episodes with exact tokens, masks, logprobs and versions."""

from relax_gym.rollout.config import RolloutConfig, RolloutLimits
from relax_gym.rollout.manager import EnvPool, RolloutManager
from relax_gym.rollout.tokens import ConversationTokens, TemplateError

__all__ = ["ConversationTokens", "EnvPool", "RolloutConfig", "RolloutLimits", "RolloutManager", "TemplateError"]
