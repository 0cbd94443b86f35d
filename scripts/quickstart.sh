#!/usr/bin/env bash
# The main job on a fresh machine: install, then train the tiny model on single-digit addition
# (GRPO, async with max_staleness 1, CPU) for a few minutes. Each run gets a fresh folder under
# runs/ (an existing folder would resume from its checkpoint); it ends with the reward plot's path.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
. .venv/bin/activate
run_dir="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
relax-gym train examples/configs/quickstart.yaml "run_dir=$run_dir" "$@"
echo "reward plot: $run_dir/reward.png   metrics: $run_dir/metrics.jsonl   tensorboard --logdir $run_dir"
