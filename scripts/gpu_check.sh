#!/usr/bin/env bash
# Certifies a machine with an NVIDIA GPU for relax_gym's GPU path: installs the project (test and megatron extras)
# into .venv, runs the tests marked `gpu` (which skip on a CPU), then the GPU path's benchmark on random-weight
# Qwen3 shapes (nothing is downloaded), printing one table per shape. Extra arguments go to the benchmark
# (e.g. --peak-tflops for a GPU other than an H100).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test,megatron
. .venv/bin/activate
python - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device on this machine")
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name()}")
PY
status=0
python -m pytest -m gpu -q -p no:cacheprovider || status=$?
if [ "$status" -ne 0 ]; then
  echo "gpu_check: the GPU tests failed (pytest exit $status; 5 means none ran)" >&2
  exit "$status"
fi
for shape in qwen3-0.6b qwen3-1.7b qwen3-4b; do
  python benchmarks/gpu_path.py --shape "$shape" "$@"
done
