"""`relax-gym rollout` and `relax-gym eval`: episodes from an env id and a model to a JSONL file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax_gym.cpu.process import settle_heap
from relax_gym.engines.factory import make_engine
from relax_gym.env.registration import resolve_env_id
from relax_gym.errors import RunStopped, StartupError
from relax_gym.models import LoadedModel, load_model
from relax_gym.rollout.config import RolloutConfig
from relax_gym.rollout.evaluation import EVAL_SEED_OFFSET, EvalReport, eval_report
from relax_gym.rollout.manager import RolloutManager
from relax_gym.rollout.metrics import status_breakdown, summarize
from relax_gym.rollout.startup import EnvUse, check_run
from relax_gym.trajectory import Trajectory, append_jsonl


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
    return summarize(await play_to_file(env_id=env_id, model=model, n=n, out=out, rollout=rollout, seed=seed,
                                        env_kwargs=env_kwargs))


async def eval_to_file(*, env_id: str, model: str | LoadedModel, n: int, out: str | Path,
                       rollout: RolloutConfig, k: int = 1, env_kwargs: dict[str, Any] | None = None,
                       pass_reward: float = 1.0) -> EvalReport:
    """pass@1 and pass@k on the held-out tasks 0..n-1 (seeds from `EVAL_SEED_OFFSET`, as a training run's eval
    draws them), `rollout.group_size` samples each (at least k), trajectories written to `out`."""
    if rollout.group_size < k:
        raise StartupError(f"pass@{k} needs at least {k} samples per task, not {rollout.group_size}")
    if rollout.group_size > 1 and rollout.temperature == 0:
        raise StartupError(f"{rollout.group_size} samples per task at temperature 0 are one answer repeated: "
                           "give a temperature above 0")
    done = await play_to_file(env_id=env_id, model=model, n=n, out=out, rollout=rollout, seed=EVAL_SEED_OFFSET,
                              env_kwargs=env_kwargs)
    return eval_report(resolve_env_id(env_id), done, k=k, pass_reward=pass_reward)


async def play_to_file(*, env_id: str, model: str | LoadedModel, n: int, out: str | Path,
                       rollout: RolloutConfig | None = None, seed: int = 0,
                       env_kwargs: dict[str, Any] | None = None) -> list[Trajectory]:
    """`rollout_to_file`'s episodes, returned rather than summarised."""
    if rollout is None:
        rollout = RolloutConfig()  # its defaults: the CLI's settings when none are given
    env_id = resolve_env_id(env_id)
    loaded = load_model(model) if isinstance(model, str) else model
    check_run(loaded, [EnvUse(env_id, env_kwargs or {}, "--env")], max_total_tokens=rollout.max_total_tokens,
              max_new_tokens=rollout.max_new_tokens, seed=seed, concurrency=rollout.concurrency)
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
    return done
