"""Held-out evaluation: which tasks, and pass@1 / pass@k with 95 % intervals from their trajectories.

`relax-gym eval` and a training run's eval rows read their figures here, over the same draw of tasks: task
i is the env's reset with seed `EVAL_SEED_OFFSET + i` (a run's training seeds all lie below it, so the two never
share a task), with the env's kwargs (a run adds its `eval_kwargs`). A sample passes when its reward reaches
`pass_reward` (default 1.0: full credit); a failed or aborted episode never passes.

pass@k is the unbiased estimator over n >= k samples per task (Chen et al., 2021: 1 - C(n-c, k) / C(n, k) for c
passing samples), averaged over tasks; its interval is the normal approximation over the per-task values
(mean +- 1.96 standard errors, clipped to [0, 1]): with 32 tasks it is about +-0.17 around 0.5, which is why
a before / after comparison wants more tasks than a quick look.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import fmean, stdev
from typing import Any

from relax_gym.trajectory import Trajectory

#: held-out tasks never share a seed with training tasks
EVAL_SEED_OFFSET = 1_000_000_000
Z_95 = 1.959964


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n, c of them passing,
    passes: 1 - C(n-c, k) / C(n, k), as a product (no large binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def interval(values: Sequence[float]) -> tuple[float, float]:
    """The 95 % normal-approximation interval of the mean of `values`, clipped to [0, 1] (a point for one)."""
    mean = fmean(values)
    if len(values) < 2:
        return mean, mean
    half = Z_95 * stdev(values) / math.sqrt(len(values))
    return max(0.0, mean - half), min(1.0, mean + half)


@dataclass(frozen=True)
class EvalReport:
    """One env's held-out figures."""

    env_id: str
    tasks: int
    samples_per_task: int
    k: int
    pass_at_1: float
    pass_at_1_ci: tuple[float, float]
    pass_at_k: float
    pass_at_k_ci: tuple[float, float]
    reward_mean: float
    #: episodes by how they ended (completed, truncated, failed, aborted)
    status: dict[str, int]
    generated_tokens_mean: float

    def row(self) -> dict[str, Any]:
        """JSON-ready, the intervals as [low, high]."""
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}


def eval_report(env_id: str, trajectories: Sequence[Trajectory], k: int = 1, pass_reward: float = 1.0) -> EvalReport:
    """pass@1 and pass@k of `trajectories` (one env's, grouped into tasks by `group_id`, each task's samples
    equal in number, at least k)."""
    if not trajectories:
        raise ValueError(f"{env_id}: no trajectories to evaluate")
    tasks: dict[str, list[Trajectory]] = {}
    for trajectory in trajectories:
        tasks.setdefault(trajectory.group_id, []).append(trajectory)
    sizes = {len(samples) for samples in tasks.values()}
    if len(sizes) != 1 or min(sizes) < k:
        raise ValueError(f"{env_id}: pass@{k} needs the same number (>= {k}) of samples per task, got {sorted(sizes)}")
    n = sizes.pop()
    passing = [sum(_passes(t, pass_reward) for t in samples) for samples in tasks.values()]
    first = [pass_at_k(n, c, 1) for c in passing]
    at_k = [pass_at_k(n, c, k) for c in passing]
    return EvalReport(
        env_id=env_id, tasks=len(tasks), samples_per_task=n, k=k,
        pass_at_1=fmean(first), pass_at_1_ci=interval(first), pass_at_k=fmean(at_k), pass_at_k_ci=interval(at_k),
        reward_mean=fmean(t.reward for t in trajectories),
        status=dict(Counter(t.status for t in trajectories)),
        generated_tokens_mean=fmean(sum(t.loss_mask) for t in trajectories),
    )


def _passes(trajectory: Trajectory, pass_reward: float) -> bool:
    return trajectory.status not in ("failed", "aborted") and trajectory.reward >= pass_reward
