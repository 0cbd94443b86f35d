"""DeepEyes-style visual search: zoom and rotate tools over an image (`relax/DeepEyes-v0`)."""

from relax_gym.envs.deepeyes.env import DeepEyesEnv

__all__ = ["DeepEyesEnv"]
