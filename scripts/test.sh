#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh Debian machine, then lints (ruff), type-checks (mypy) and runs it.
# As root it also starts podman's Docker API, builds the sandbox image and installs Chromium,
# so the sandbox and viewer tests run against the real engine and browser; elsewhere they skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test,reasoning-gym,gem,textarena,openenv,verifiers,megatron,ray
bash scripts/setup_openenv_venv.sh  # OpenEnv's servers, which the relax/OpenEnv-v0 tests start
bash scripts/setup_vllm_venv.sh  # a real vLLM server (its own venv: it pins its own torch), cached per machine
. .venv/bin/activate
if [ "$(id -u)" = 0 ]; then
  export "$(bash scripts/start_podman.sh | tail -n 1)"
  bash scripts/build_sandbox_image.sh
  bash scripts/install_browser.sh
fi
ruff check .
python scripts/typecheck.py  # mypy over the package as installed (settings: pyproject.toml [tool.mypy])
python scripts/make_smollm2.py  # the real pretrained models of the suite, made once per machine (~/.cache/relax_gym)
python scripts/make_qwen_coder.py
python -m pytest "$@"
