"""Rollouts: concurrent multi-turn episodes with exact tokens, masks, logprobs and versions."""

from relax_gym.rollout.manager import EnvPool, RolloutLimits, RolloutManager, settle_heap
from relax_gym.rollout.tokens import ConversationTokens, TemplateError

__all__ = ["ConversationTokens", "EnvPool", "RolloutLimits", "RolloutManager", "TemplateError", "settle_heap"]
