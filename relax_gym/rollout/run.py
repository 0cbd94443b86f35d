"""`relax-gym rollout`: episodes from an env id and a model to a JSONL file."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_gym.engines.factory import make_engine
from relax_gym.errors import RunStopped
from relax_gym.models import LoadedModel, load_model
from relax_gym.registration import resolve_env_id
from relax_gym.rollout.manager import RolloutManager, settle_heap
from relax_gym.rollout.metrics import status_breakdown, summarize
from relax_gym.rollout.startup import EnvUse, check_run
from relax_gym.trajectory import Trajectory, append_jsonl

if TYPE_CHECKING:  # the rollout package does not import the trainer's at run time
    from relax_gym.trainer.config import RolloutConfig


async def rollout_to_file(*, env_id: str, model: str | LoadedModel, n: int, out: str | Path,
                          rollout: RolloutConfig | None = None, seed: int = 0,
                          env_kwargs: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Runs `n` groups of `rollout.group_size` episodes; each group is written (and flushed) as soon as it finishes.

    `rollout` is the training config's `rollout:` section (its defaults when None), so a rollout samples as a
    training run with the same settings does. `model` is a name or folder, or a model already loaded (with its
    template options). `env_id` may be a `file.py` or module that registers the env. Everything is checked
    before the first episode (`startup.check_run`, StartupError); if every episode fails or aborts, the file is
    kept and RunStopped says why.
    """
    if rollout is None:
        from relax_gym.trainer.config import RolloutConfig  # its defaults: the CLI's settings when none are given

        rollout = RolloutConfig()
    env_id = resolve_env_id(env_id)
    loaded = load_model(model) if isinstance(model, str) else model
    check_run(loaded, [EnvUse(env_id, env_kwargs or {}, "--env")], max_total_tokens=rollout.max_total_tokens,
              max_new_tokens=rollout.max_new_tokens, seed=seed)
    engine = make_engine(loaded, rollout, seed=seed)
    manager = RolloutManager(
        engine, loaded, sampling=rollout.sampling_params(), limits=rollout.limits(),
        max_concurrency=rollout.concurrency,
        sampling_seed=seed,  # the same command samples the same trajectories
    )
    settle_heap()
    done: list[Trajectory] = []
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:

        def write(group: list[Trajectory]) -> None:
            append_jsonl(f, group)
            done.extend(group)

        try:
            await engine.connect()  # a server left paused by a killed run serves again
            await manager.run(env_id, n, rollout.group_size, seed=seed, env_kwargs=env_kwargs, on_group=write)
        finally:
            await manager.close()
            await engine.close()
    if done and all(t.status in ("failed", "aborted") for t in done):
        raise RunStopped(f"every episode of {env_id} failed or aborted (trajectories in {path}): "
                         f"{status_breakdown(done)}")
    return summarize(done)
