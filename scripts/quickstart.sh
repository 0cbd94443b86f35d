#!/usr/bin/env bash
# The main job on a fresh machine. Until the trainer lands (issue 4), it is the most complete job
# that exists: install, list the bundled environments, conformance-check every one of them and the
# custom-env example, and play a scripted episode of the example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
. .venv/bin/activate
relax-gym envs
relax-gym check $(relax-gym envs --json | python -c 'import json,sys; print(" ".join(e["id"] for e in json.load(sys.stdin) if "error" not in e))') examples/custom_env.py
python examples/custom_env.py
echo "quickstart: training is not in this version yet; see the README's status section."
