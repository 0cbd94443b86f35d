"""One backend call per step against two: the trainer's side of a step when the backend lives in another process.

Until 7e10f95 a step with `algorithm.recompute_old_logprobs: true` called the backend twice: `logprobs` (the old
logprobs, attached on the controller) and then `train_step` with the same samples, so through
`trainer.own_process`'s pipe or a Ray actor the samples crossed twice. Now `train_step(recompute_old_logprobs=True)`
does both where the weights live. This runs the same training through the CLI (`python -m relax_gym.cli train`,
checkpoints and logs on) from a git worktree of the commit before the change (`--baseline`) and from this tree,
alternating A B A B, for each transport:

- `own_process`: `trainer.own_process=true` (the backend in a spawned child, `ProcessBackend`);
- `cluster`: `cluster.mode=ray` with one engine, one rollout worker and trainer rank 0 as actors (`RemoteBackend`).

The setting is the quickstart's (examples/configs/quickstart.yaml: the tiny warm-start model, 16 groups of 8 one-turn
episodes a step) in sync mode with `recompute_old_logprobs=true`. Reported per step, medians over the steps after
the first of each run: `train_side_s` = logprobs_s + train_s (the old logprobs and the update, before the weights
are read out) and `step_time_s`.

    python benchmarks/backend_calls.py --baseline 55bd3af --steps 20 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
TRANSPORTS = {
    "own_process": ["trainer.own_process=true"],
    "cluster": ["cluster.mode=ray", "cluster.engines.count=1", "cluster.rollout_workers.count=1",
                "cluster.control.enabled=false"],
}


def importable(tree: Path, scratch: Path) -> Path:
    """The folder that puts `tree`'s own package first on PYTHONPATH: the tree itself for a commit whose
    `relax_gym/envs` and `relax_gym/trainer` were links, else its package laid out by scripts/package_tree.py."""
    if (tree / "relax_gym" / "envs").exists():
        return tree
    made = subprocess.run([sys.executable, str(tree / "scripts" / "package_tree.py"), str(scratch), "--root",
                           str(tree)], check=True, capture_output=True, text=True)
    return Path(made.stdout.strip())


def run(tree: Path, run_dir: Path, steps: int, transport: str) -> dict[str, float]:
    """One `relax-gym train` from `tree`'s source; the medians of its steady steps."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    overrides = [f"run_dir={run_dir}", f"model={ROOT / 'examples' / 'checkpoints' / 'tiny-arithmetic'}",
                 "trainer.mode=sync", "trainer.max_staleness=0", f"trainer.total_steps={steps}",
                 "trainer.eval_every=0", f"trainer.checkpoint_every={steps}",
                 "algorithm.recompute_old_logprobs=true", *TRANSPORTS[transport]]
    env = {**os.environ, "PYTHONPATH": str(importable(tree, run_dir.parent / "package"))}
    subprocess.run([sys.executable, "-m", "relax_gym.cli", "train", str(ROOT / "examples/configs/quickstart.yaml"),
                    *overrides], check=True, cwd=run_dir.parent, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = [r for r in rows if r["type"] == "train"][1:]
    return {"train_side_s": median(r["logprobs_s"] + r["train_s"] for r in steady),
            "logprobs_s": median(r["logprobs_s"] for r in steady),
            "step_time_s": median(r["step_time_s"] for r in steady)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the commit before the change (two calls a step)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=list(TRANSPORTS))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="backend-calls-"))
    baseline = work / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(baseline), args.baseline], check=True,
                   stdout=subprocess.DEVNULL)
    try:
        trees = {"two calls (baseline)": baseline, "one call (this tree)": ROOT}
        results: dict[str, dict[str, list[dict[str, float]]]] = {}
        for transport in args.transports:
            for repeat in range(args.repeats):
                for name, tree in trees.items():
                    out = run(tree, work / f"{transport}-{repeat}-{name.split()[0]}", args.steps, transport)
                    results.setdefault(transport, {}).setdefault(name, []).append(out)
                    print(f"{transport} #{repeat} {name}: {json.dumps(out)}", flush=True)
        print("\n| transport | calls a step | train side s/step | of it, old logprobs s | step s | ratio (train side) "
              "|")
        print("|---|---|---|---|---|---|")
        for transport, by_tree in results.items():
            base = median(r["train_side_s"] for r in by_tree["two calls (baseline)"])
            for name, runs in by_tree.items():
                side = median(r["train_side_s"] for r in runs)
                print(f"| {transport} | {name} | {side:.3f} | {median(r['logprobs_s'] for r in runs):.3f} | "
                      f"{median(r['step_time_s'] for r in runs):.3f} | {side / base:.2f}x |")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
