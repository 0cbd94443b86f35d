"""Per-env rollout metrics: what a run did, where its time went, and what failed."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from statistics import fmean
from typing import Any

from relax_gym.trajectory import Trajectory


def reason_kind(reason: str) -> str:
    """The stable part of a failure reason ("env step raised ValueError: ..." -> "env step raised ValueError")."""
    return reason.split(":", 1)[0] if reason else ""


def summarize(trajectories: Iterable[Trajectory]) -> dict[str, dict[str, Any]]:
    by_env: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_env[t.env_id].append(t)
    out = {}
    for env_id, trajs in sorted(by_env.items()):
        m = [t.metrics for t in trajs]
        out[env_id] = {
            "episodes": len(trajs),
            "reward_mean": fmean(t.reward for t in trajs),
            "status": dict(Counter(t.status for t in trajs)),
            "failures": dict(Counter(reason_kind(t.status_reason) for t in trajs if t.status in ("failed", "aborted"))),
            #: one whole reason per kind of failure, for a person to read
            "failure_examples": _first_by_kind(t.status_reason for t in trajs if t.status in ("failed", "aborted")),
            "truncations": dict(Counter(t.status_reason for t in trajs if t.status == "truncated")),
            "turns_mean": fmean(x.get("turns", 0) for x in m),
            "tool_calls_mean": fmean(x.get("tool_calls", 0) for x in m),
            "tokens_mean": fmean(len(t.token_ids) for t in trajs),
            "generated_tokens_mean": fmean(t.num_generated for t in trajs),
            "generate_s": sum(x.get("generate_s", 0.0) for x in m),
            "env_s": sum(x.get("env_s", 0.0) for x in m),
            "rerender_mismatches": sum(1 for x in m if x.get("rerender_match") is False
                                       and not x.get("rerender_expected")),
            "rerender_expected_diffs": sum(1 for x in m if x.get("rerender_expected")),
            "reward_failures": reward_failures(trajs),
        }
    return out


def _first_by_kind(reasons: Iterable[str]) -> dict[str, str]:
    first: dict[str, str] = {}
    for reason in reasons:
        first.setdefault(reason_kind(reason), reason)
    return first


def reward_failures(trajectories: Iterable[Trajectory]) -> dict[str, int]:
    """Episodes whose reward could not be computed, by the reward's status (`timeout`, `error`): they score 0
    without being wrong, so a run reports them apart from wrong answers."""
    return dict(Counter(s for t in trajectories if (s := t.metrics.get("reward_status", "ok")) != "ok"))


def status_breakdown(trajectories: Iterable[Trajectory], examples: int = 3) -> str:
    """One line for a person: how many episodes ended how, and the commonest reasons with one full example each."""
    trajs = list(trajectories)
    statuses = Counter(t.status for t in trajs)
    reasons = Counter(reason_kind(t.status_reason) for t in trajs if t.status_reason)
    first = _first_by_kind(t.status_reason for t in trajs)
    parts = [f"{len(trajs)} episodes: " + ", ".join(f"{n} {s}" for s, n in statuses.most_common())]
    parts += [f"{n}x {k!r}" + ("" if first[k] == k else f", e.g. {first[k][:200]!r}")
              for k, n in reasons.most_common(examples)]
    return "; ".join(parts)
