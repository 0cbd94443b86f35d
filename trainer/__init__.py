"""relax_gym.trainer: algorithms, backends (torch, megatron) and the sync/async train loop."""
