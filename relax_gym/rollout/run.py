"""`relax-gym rollout`: episodes from an env id and a model to a JSONL file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relax_gym.engines.base import Engine, SamplingParams
from relax_gym.errors import RunStopped
from relax_gym.models import LoadedModel, load_model
from relax_gym.registration import resolve_env_id
from relax_gym.rollout.manager import RolloutLimits, RolloutManager, settle_heap
from relax_gym.rollout.metrics import status_breakdown, summarize
from relax_gym.rollout.startup import EnvUse, check_run
from relax_gym.trajectory import Trajectory


def make_engine(loaded: Any, engine_url: str | None = None, *, outage_timeout_s: float = 120.0,
                **embedded: Any) -> Engine:
    """An SGLang client when a URL is given (an unlimited connection pool: the run's concurrency is the cap),
    else the embedded engine over `loaded` (`embedded` kwargs)."""
    if engine_url:
        from relax_gym.engines.sglang import SGLangEngine

        return SGLangEngine(engine_url, outage_timeout_s=outage_timeout_s, max_connections=None)
    from relax_gym.engines.embedded import EmbeddedEngine

    return EmbeddedEngine(loaded, **embedded)


async def rollout_to_file(*, env_id: str, model: str | LoadedModel, n: int, group: int, out: str | Path, seed: int = 0,
                          engine_url: str | None = None, env_kwargs: dict[str, Any] | None = None,
                          temperature: float = 1.0, max_new_tokens: int = 128, max_turns: int = 8,
                          max_total_tokens: int = 4096, concurrency: int = 256) -> dict[str, dict[str, Any]]:
    """Runs `n` groups of `group` episodes; each group is written (and flushed) as soon as it finishes.

    `model` is a name or folder, or a model already loaded (with its template options).
    `env_id` may be a `file.py` or module that registers the env. Everything is
    checked before the first episode (`startup.check_run`, StartupError); if
    every episode fails or aborts, the file is kept and RunStopped says why.
    """
    env_id = resolve_env_id(env_id)
    loaded = load_model(model) if isinstance(model, str) else model
    check_run(loaded, [EnvUse(env_id, env_kwargs or {}, "--env")], max_total_tokens=max_total_tokens,
              max_new_tokens=max_new_tokens, seed=seed)
    engine = make_engine(loaded, engine_url)
    manager = RolloutManager(
        engine, loaded,
        sampling=SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens),
        limits=RolloutLimits(max_turns=max_turns, max_total_tokens=max_total_tokens),
        max_concurrency=concurrency,
        sampling_seed=seed,  # the same command samples the same trajectories
    )
    settle_heap()
    done: list[Trajectory] = []
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:

        def write(group_trajs: list[Trajectory]) -> None:
            for t in group_trajs:
                f.write(json.dumps(t.to_json(), ensure_ascii=False) + "\n")
            f.flush()
            done.extend(group_trajs)

        try:
            await engine.connect()  # a server left paused by a killed run serves again
            await manager.run(env_id, n, group, seed=seed, env_kwargs=env_kwargs, on_group=write)
        finally:
            await manager.close()
            await engine.close()
    if done and all(t.status in ("failed", "aborted") for t in done):
        raise RunStopped(f"every episode of {env_id} failed or aborted (trajectories in {path}): "
                         f"{status_breakdown(done)}")
    return summarize(done)
