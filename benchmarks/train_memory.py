"""Peak memory of a training run as users start it (`relax-gym train CONFIG`), against what its state needs.

Each variant (`--variants`, override lists) runs the CLI in a fresh process, checkpoints and logs on. The peak
is the child's maximum RSS; the state is counted from the model's parameters: the engine's copy, the trainer's
weights and gradients, and AdamW's two moments, all float32 (20 bytes a parameter), plus the process before any
model loads (Python, torch, transformers: measured by importing them). The training phase's seconds per step come
from the run's metrics.

    python benchmarks/train_memory.py --config examples/configs/smollm2_arithmetic.yaml --steps 20
    python benchmarks/train_memory.py --config examples/configs/quickstart.yaml --steps 4 --variants ""
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BASELINE = "import torch, transformers, relax_gym.trainer.loop"


def peak_rss_gb(command: list[str]) -> float:
    """Runs `command` to its end in a child of a fresh interpreter; the child's maximum RSS in GB (RUSAGE_CHILDREN
    keeps the largest child so far, so each measurement gets a parent of its own)."""
    probe = [sys.executable, "-c", "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)", *command]
    done = subprocess.run(probe, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return int(done.stdout.split()[-1]) / 1e6  # Linux: kilobytes


def parameters(config: str) -> int:
    """The config's model's parameter count, loaded as the run loads it."""
    code = ("import sys; from relax_gym.trainer.config import load_config; "
            "from relax_gym.trainer.policy import load_policy; m = load_policy(load_config(sys.argv[1])).model; "
            "print(sum(p.numel() for p in {p.data_ptr(): p for p in m.parameters()}.values()))")
    return int(subprocess.run([sys.executable, "-c", code, config], capture_output=True, text=True,
                              check=True).stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--variants", nargs="+", default=["", "trainer.gradient_checkpointing=true"],
                        help="space-separated overrides per variant, one string each")
    args = parser.parse_args()
    runtime = peak_rss_gb([sys.executable, "-c", BASELINE])
    count = parameters(args.config)
    state = 20 * count / 1e9
    print(f"{count / 1e6:.1f}M parameters: state {state:.2f} GB (engine copy, weights, gradients, two AdamW moments, "
          f"float32) + {runtime:.2f} GB of runtime before any model\n")
    print("| variant | peak RSS | peak / (state + runtime) | training s/step (median) |\n|---|---:|---:|---:|")
    for variant in args.variants:
        with tempfile.TemporaryDirectory() as run_dir:
            peak = peak_rss_gb([sys.executable, "-m", "relax_gym.cli", "train", args.config, f"run_dir={run_dir}",
                                f"trainer.total_steps={args.steps}", *variant.split()])
            rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
            train_s = statistics.median(r["train_s"] for r in rows if "train_s" in r)
        print(f"| {variant or 'as configured'} | {peak:.2f} GB | {peak / (state + runtime):.2f}x | {train_s:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
