#!/usr/bin/env bash
# Creates .venv-openenv with OpenEnv's server side, which the relax/OpenEnv-v0 tests start as processes
# (tests/support/openenv_servers.py). It is a venv of its own because openenv 0.10 needs mcp<2 (FastMCP 3) and
# the verifiers extra pins mcp 2.0, so the two cannot share .venv; relax_gym's client needs neither. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-openenv/bin/python ]; then
  python3 -m venv .venv-openenv
fi
.venv-openenv/bin/python -c 'import openenv, uvicorn' 2>/dev/null || \
  .venv-openenv/bin/python -m pip install -q "openenv>=0.10,<0.11" "uvicorn>=0.29"
