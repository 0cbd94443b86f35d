#!/usr/bin/env bash
# Creates .venv and installs relax_gym with the given extras (comma-separated, e.g. test,megatron); safe to rerun.
# torch==2.13.0 goes first: an unpinned torch pulls several GB of CUDA wheels on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c 'import torch' 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".${extras:+[$extras]}"
