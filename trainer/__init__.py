"""relax_gym.trainer: algorithms, backends (torch, megatron) and the sync/async train loop."""

# An editable install puts the repo root on sys.path, where this folder is also `trainer`: one name, one copy.
if __name__ != "relax_gym.trainer":
    raise ImportError(f"this folder is the relax_gym.trainer package: import relax_gym.trainer, not {__name__}")
