"""What a run leaves behind: metrics.jsonl, TensorBoard events, trajectories, a progress bar, a reward plot.

Every line is flushed as it is written, so a run that is killed keeps
everything up to its last step; a resumed run drops the lines after the
checkpoint it resumes from (and TensorBoard purges them), so a step never
appears twice anywhere.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path
from statistics import fmean
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from relax_gym.rollout.evaluation import eval_report
from relax_gym.rollout.metrics import reward_failures, status_breakdown
from relax_gym.trainer.batch import Sample
from relax_gym.trainer.databus import Group, group_staleness
from relax_gym.trajectory import Trajectory, append_jsonl

#: seconds between the plain progress lines of a run whose output is not a terminal
PLAIN_PROGRESS_EVERY_S = 30.0


class RunLog:
    def __init__(self, run_dir: Path, total_steps: int, *, save_trajectories: bool = True):
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.trajectories_path = self.run_dir / "trajectories.jsonl" if save_trajectories else None
        self.total_steps = total_steps
        self.start = time.perf_counter()
        self.last_step_time = self.start
        #: this process's CPU seconds (all its threads) at the last step's row: `cpu_s` over `step_time_s` is how
        #: many cores the step kept busy, and on C cores no overlap of its phases can beat cpu_s / C
        self.last_cpu = time.process_time()
        self._last_plain_line = self.start
        self._metrics = self.metrics_path.open("a", encoding="utf-8")
        self._trajs = self.trajectories_path.open("a", encoding="utf-8") if self.trajectories_path else None
        self._tb = _tensorboard(self.run_dir / "tensorboard")
        self._warned_max_new_tokens = False
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[status]}"), TimeElapsedColumn())
        self._bar = self.progress.add_task("train", total=total_steps, status="")
        self.progress.start()

    # --- writing ---------------------------------------------------------------------
    def _write(self, record: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            prefix = record["type"]
            for key, value in _flatten(record).items():
                if isinstance(value, int | float) and key not in ("step", "type"):
                    # the optimizer's metrics are already "train/loss" in the record: not "train/train/loss"
                    tag = key if key.startswith(f"{prefix}/") else f"{prefix}/{key}"
                    self._tb.add_scalar(tag, value, record["step"])
            self._tb.flush()

    def step(self, step: int, groups: list[Group], samples: list[Sample], train: dict[str, float],
             timings: dict[str, float], counters: dict[str, Any]) -> dict[str, Any]:
        """One line per optimizer step; `counters` are run totals (filtered / stale-dropped groups, ...)."""
        now, cpu = time.perf_counter(), time.process_time()
        trajs = [t for g in groups for t in g]
        per_env: dict[str, list[float]] = defaultdict(list)
        for t in trajs:
            per_env[t.env_id].append(t.reward)
        generated = sum(t.num_generated for t in trajs)
        record: dict[str, Any] = {
            "type": "train",
            "step": step,
            "time_s": round(now - self.start, 3),
            "reward_mean": fmean(t.reward for t in trajs) if trajs else 0.0,
            "reward_per_env": {k: fmean(v) for k, v in per_env.items()},
            "staleness": dict(Counter(group_staleness(g, step - 1) for g in groups)),
            "episodes": len(trajs),
            "trained_samples": len(samples),
            "status": dict(Counter(t.status for t in trajs)),
            "truncated_by": dict(Counter(t.status_reason for t in trajs if t.status == "truncated")),
            "reward_failures": reward_failures(trajs),
            "generated_tokens_mean": generated / len(trajs) if trajs else 0.0,
            "trained_generated_tokens_mean": fmean(sum(s.loss_mask) for s in samples) if samples else 0.0,
            "trained_seq_len_mean": fmean(len(s.token_ids) for s in samples) if samples else 0.0,
            "tokens_per_s": generated / max(now - self.last_step_time, 1e-9),
            "step_time_s": now - self.last_step_time,
            "cpu_s": round(cpu - self.last_cpu, 3),
            **counters,
            **{k: round(v, 6) for k, v in timings.items()},
            **{f"train/{k}": v for k, v in train.items()},
        }
        self.last_step_time, self.last_cpu = now, cpu
        self._write(record)
        if self._trajs is not None:
            # without routed experts: ~1 KB a token on a large MoE model, 40x the rest of the record, and only the
            # trainer reads them
            kept = [replace(t, routed_experts=None) if t.routed_experts is not None else t for t in trajs]
            append_jsonl(self._trajs, kept, step=step)
        self.progress.update(self._bar, completed=step, status=f"reward {record['reward_mean']:.3f}")
        if not self.progress.console.is_terminal and (
                now - self._last_plain_line >= PLAIN_PROGRESS_EVERY_S or step in (1, self.total_steps)):
            # no bar is drawn when the output is a file or a pipe: a plain line every half minute instead
            self._last_plain_line = now
            self.note(f"step {step}/{self.total_steps}: reward {record['reward_mean']:.3f}, "
                      f"{record['step_time_s']:.1f} s/step, {record['generated_tokens_mean']:.1f} tokens generated "
                      f"per episode, {now - self.start:.0f} s so far")
        cut = record["truncated_by"].get("max_new_tokens", 0)
        if cut * 2 >= len(trajs) > 0 and not self._warned_max_new_tokens:
            self._warned_max_new_tokens = True
            self.note(f"[yellow]step {step}: {cut} of {len(trajs)} episodes hit rollout.max_new_tokens before "
                      "ending their turn, so they were not graded (reward 0); raise it if answers are cut off[/yellow]")
        return record

    def note(self, text: str) -> None:
        """One line for the person watching (above the progress bar)."""
        self.progress.console.print(text, highlight=False, soft_wrap=True)

    def event(self, step: int, kind: str, **fields: Any) -> dict[str, Any]:
        """A role's failure or recovery in a distributed run, as a line of events.jsonl. That file is never
        truncated by a resume: it records what happened, to steps trained again afterwards too."""
        record = {"type": "event", "event": kind, "step": step, "time_s": round(time.perf_counter() - self.start, 3),
                  **fields}
        with (self.run_dir / "events.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")
        detail = ", ".join(f"{k}={v}" for k, v in fields.items())
        self.note(f"[cyan]{kind}[/cyan] at step {step}: {detail}")
        return record

    def eval(self, version: int, results: dict[str, list[Trajectory]]) -> dict[str, float]:
        """One eval row; an env whose every episode failed or aborted gets an `error` beside its (zero) score, so a
        broken eval is never mistaken for a model that scores 0."""
        # what `relax-gym eval` reports for the same tasks; the row's scores and statuses are read off it
        reports = {env: eval_report(env, r) for env, r in results.items() if r}
        scores = {env: report.reward_mean for env, report in reports.items()}
        broken = {env: status_breakdown(r) for env, r in results.items()
                  if r and all(t.status in ("failed", "aborted") for t in r)}
        record: dict[str, Any] = {"type": "eval", "step": version,
                                  "reward_mean": fmean(scores.values()) if scores else 0.0, "reward_per_env": scores,
                                  "status": {env: reports[env].status if env in reports else {} for env in results},
                                  "per_env": {env: report.row() for env, report in reports.items()}}
        if broken:
            record["error"] = "; ".join(f"{env}: {why}" for env, why in broken.items())
        self._write(record)
        self.note(f"eval at step {version}: reward {record['reward_mean']:.3f} {scores}")
        if broken:
            self.note(f"[red]eval at step {version}: every episode failed: {record['error']}[/red]")
        return scores

    def eval_error(self, version: int, reason: str) -> None:
        """An eval that raised: logged as such (and so counted), never silently missing."""
        self._write({"type": "eval", "step": version, "error": reason})
        self.note(f"[red]eval at step {version} failed: {reason}[/red]")

    # --- reading / resuming -------------------------------------------------------------
    def records(self, kind: str = "train") -> list[dict[str, Any]]:
        if not self.metrics_path.is_file():
            return []
        rows = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]
        return [r for r in rows if r["type"] == kind]

    def truncate_after(self, step: int) -> None:
        """Forgets what a killed run logged after the checkpoint it resumes from."""
        self._metrics.close()
        rows = [line for line in self.metrics_path.read_text().splitlines() if line.strip()]
        kept = [line for line in rows if json.loads(line)["step"] <= step]
        self.metrics_path.write_text("".join(line + "\n" for line in kept))
        self._metrics = self.metrics_path.open("a", encoding="utf-8")
        if self._trajs is not None and self.trajectories_path is not None and self.trajectories_path.is_file():
            self._trajs.close()
            lines = self.trajectories_path.read_text(encoding="utf-8").splitlines()
            self.trajectories_path.write_text(
                "".join(x + "\n" for x in lines if x.strip() and json.loads(x)["step"] <= step), encoding="utf-8")
            self._trajs = self.trajectories_path.open("a", encoding="utf-8")
        if self._tb is not None:  # events after `step` are purged from TensorBoard's view of the run
            self._tb.close()
            self._tb = _tensorboard(self.run_dir / "tensorboard", purge_step=step + 1)
        self.progress.update(self._bar, completed=step)

    def summary(self) -> dict[str, Any]:
        """The whole run as metrics.jsonl holds it (every invocation of a resumed run): the training reward's
        first and last tenth, and the first and last held-out evals ((step, reward) pairs, None without)."""
        rewards = [r["reward_mean"] for r in self.records()]
        tenth = max(1, len(rewards) // 10)
        first = fmean(rewards[:tenth]) if rewards else 0.0
        last = fmean(rewards[-tenth:]) if rewards else 0.0
        evals = [(r["step"], r["reward_mean"]) for r in self.records("eval") if "reward_mean" in r]
        return {"steps": len(rewards), "reward_first_tenth": first, "reward_last_tenth": last,
                "improvement": last - first, "eval_first": evals[0] if evals else None,
                "eval_last": evals[-1] if evals else None, "run_dir": str(self.run_dir),
                "plot": str(self.run_dir / "reward.png")}

    def close(self, plot: bool = True) -> None:
        self.progress.stop()
        self._metrics.close()
        if self._trajs is not None:
            self._trajs.close()
        if self._tb is not None:
            self._tb.close()
        if plot:
            plot_rewards(self.metrics_path, self.run_dir / "reward.png")


def plot_rewards(metrics_path: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in Path(metrics_path).read_text().splitlines() if x.strip()]
    train = [r for r in rows if r["type"] == "train"]
    evals = [r for r in rows if r["type"] == "eval" and "reward_mean" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        steps = [r["step"] for r in train]
        rewards = [r["reward_mean"] for r in train]
        ax.plot(steps, rewards, alpha=0.35, label="train reward (per step)")
        window = max(1, len(rewards) // 10)
        smooth = [fmean(rewards[max(0, i - window + 1): i + 1]) for i in range(len(rewards))]
        ax.plot(steps, smooth, label=f"train reward (mean of {window})")
    if evals:
        ax.plot([r["step"] for r in evals], [r["reward_mean"] for r in evals], "o-", label="eval reward (greedy)")
    ax.set_xlabel("step (policy version)")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    if train or evals:
        ax.legend()
    else:  # a run that stopped before its first step: an empty plot that says so
        ax.text(0.5, 0.5, "no step was trained", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "/"))
        else:
            out[name] = value
    return out


def _tensorboard(path: Path, purge_step: int | None = None) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is a dependency; this only guards a broken install
        return None
    return SummaryWriter(str(path), purge_step=purge_step)
