"""The run's composition root: `train(cfg)` picks how a config runs (in this process, as a Ray cluster, or as a
torchrun rank following rank 0's backend calls) and starts it. It sits above the loop and the cluster run so
that neither imports the other."""

from __future__ import annotations

import asyncio
from typing import Any

from relax_gym.errors import StartupError
from relax_gym.trainer.algorithms import make_loss_fn
from relax_gym.trainer.config import TrainConfig
from relax_gym.trainer.distributed import follow, world
from relax_gym.trainer.loop import Trainer
from relax_gym.trainer.policy import load_policy, make_backend


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Runs a training job; under torchrun, rank 0 trains and the other ranks follow its backend calls."""
    rank, size = world()
    if cfg.cluster is not None:
        if size > 1:
            raise StartupError("a cluster run starts its own trainer ranks as Ray actors: run it without torchrun")
        from relax_gym.trainer.cluster.run import ClusterTrainer  # Ray only for a cluster run

        return asyncio.run(ClusterTrainer(cfg).run())
    if size > 1 and cfg.trainer.own_process:
        raise StartupError("trainer.own_process runs the backend in a child process, which cannot be a torchrun "
                           "rank: drop it under torchrun")
    if size > 1 and cfg.trainer.backend != "megatron":
        raise ValueError("only trainer.backend=megatron runs under torchrun; the torch backend is one process")
    if rank == 0:
        return asyncio.run(Trainer(cfg).run())
    backend = make_backend(cfg, load_policy(cfg))
    calls = follow(backend, make_loss_fn(cfg.algorithm.to_algorithm_config()))
    return {"rank": rank, "backend_calls": calls, "version": backend.version}
